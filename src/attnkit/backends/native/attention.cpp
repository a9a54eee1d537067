// attnkit's native CPU attention: one fused pass per key tile, online softmax, split keys.
//
// Shape legend (the Problem layout of attnkit/backends/base.py):
//   q    (B, H_q,  N_q, D_k)   k (B, H_kv, N_k, D_k)   v (B, H_kv, N_k, D_v)
//   out  (B, H_q,  N_q, D_v)   lse (B, H_q, N_q) float32 (float64 for float64 inputs)
//   G = H_q / H_kv query heads share one K/V head (GQA). A work item is
//   (b, kv head, query block, key split); its R = G * rows query rows are stacked
//   head-major (row r = g * rows + i  <->  head kvh * G + g, query q0 + i).
//   Per key tile of n <= BK keys:
//     S   (R, BK)    scores, then probabilities P in place
//     acc (R, DVP)   sum_j P v_j                    m, l (R,) running max / sum
//   all in the compute type A = compute_t<T>: float, or double for float64 inputs. For
//   bfloat16 / float16 the forward's Q·Kᵀ and P·V, and the backward's five products, may run
//   in T instead (lowp.h, backward.h: Q, K, V, dO, P and dS in T, fp32 accumulation;
//   ATTNKIT_NATIVE_LOWP_GEMM=0 widens them to float).
//
// Order of score terms (attnkit/scores.py): S*scale -> softcap -> ALiBi -> + relative bias
// table[h, clamp(k - q, -M, M) + M] (rel_table (H_q, 2M+1)) -> + bias -> mask.
// Masks in closed form: band  lo <= q - k <= hi  (alignment folded in by the caller),
// padding lengths (kv_len (B), q_len (B)), documents (q_doc (B, N_q) == k_doc (B, N_k)),
// and any other mask as a dense bool tensor broadcast to (B, H_q, N_q, N_k). A Python
// score_mod compiled by score_mod.py comes as two addresses (its function, its captured
// tensors' pointers; 0 = none) and runs where ALiBi / the table do (score_mod.h).
// Conventions: a row with no allowed key -> out 0, LSE -inf; NaN in an allowed score
// propagates; a key with P == 0 never touches the output (NaN in masked V rows stays out).
#include <atomic>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include "backward.h"
#include "forward.h"
#include "paged.h"

namespace attnkit_native {
namespace {

// ------------------------------------------------------------------ the operator
template <typename P> const P* opt_ptr(const std::optional<Tensor>& t) {
  return t.has_value() ? t->data_ptr<P>() : nullptr;
}

// The strides that read ``t`` (B|1, H_q|1, N_q|1, N_k|1) broadcast to (B, H_q, N_q, N_k):
// a size-1 dim reads its one entry at every index (stride 0, whatever stride it has), so a
// mask or bias comes in as it is, never expanded or copied.
void broadcast_strides(const Tensor& t, const i64 (&full)[4], i64 (&s)[4], const char* what) {
  TORCH_CHECK(t.dim() == 4 && (t.size(0) == full[0] || t.size(0) == 1) &&
                  (t.size(1) == full[1] || t.size(1) == 1) &&
                  (t.size(2) == full[2] || t.size(2) == 1) &&
                  (t.size(3) == full[3] || t.size(3) == 1),
              "attnkit native: ", what, " of shape ", t.sizes(), " does not broadcast to (B, ",
              "H_q, N_q, N_k) = (", full[0], ", ", full[1], ", ", full[2], ", ", full[3], ")");
  for (int i = 0; i < 4; ++i) s[i] = t.size(i) == 1 ? 0 : t.stride(i);
}

// The call's parameters from the operator's arguments (shared by forward and backward); the
// score terms' tensors (alibi, rel, bias) come in A's dtype.
template <typename A>
Args<A> make_args(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                  double softcap, const std::optional<Tensor>& alibi, double alibi_offset,
                  const std::optional<Tensor>& rel, int64_t rel_max_distance,
                  const std::optional<Tensor>& bias, double band_lo, double band_hi,
                  const std::optional<Tensor>& kv_len, const std::optional<Tensor>& q_len,
                  const std::optional<Tensor>& q_doc, const std::optional<Tensor>& k_doc,
                  const std::optional<Tensor>& mask, int64_t score_mod,
                  int64_t score_mod_caps) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attnkit native: q, k, v must be 4-D (B, H, N, D)");
  // (a size-1 last dim has no stride to speak of: .contiguous() keeps whatever it had)
  TORCH_CHECK((q.stride(3) == 1 || q.size(3) == 1) && (k.stride(3) == 1 || k.size(3) == 1) &&
                  (v.stride(3) == 1 || v.size(3) == 1),
              "attnkit native: the last dim of q, k, v must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attnkit native: q, k, v must share one dtype");
  constexpr at::ScalarType kA = c10::CppTypeToScalarType<A>::value;
  Args<A> a{};
  a.B = q.size(0); a.Hq = q.size(1); a.Nq = q.size(2); a.Dk = q.size(3);
  a.Hkv = k.size(1); a.Nk = k.size(2); a.Dv = v.size(3);
  a.G = a.Hq / a.Hkv;
  a.DKP = round_up(a.Dk, W); a.DVP = round_up(a.Dv, W);
  for (int i = 0; i < 3; ++i) {
    a.sq[i] = q.stride(i); a.sk[i] = k.stride(i); a.sv[i] = v.stride(i);
  }
  for (const auto* t : {&alibi, &rel, &bias})
    TORCH_CHECK(!t->has_value() || (*t)->scalar_type() == kA,
                "attnkit native: alibi, rel_table and bias must be ", kA, " for ",
                q.scalar_type(), " inputs, got ", (*t)->scalar_type());
  a.scale = A(scale); a.softcap = A(softcap);
  a.alibi = opt_ptr<A>(alibi); a.alibi_offset = A(alibi_offset);
  a.rel = opt_ptr<A>(rel); a.rel_M = rel_max_distance;
  if (a.rel)
    TORCH_CHECK(rel->is_contiguous() && rel->dim() == 2 && rel->size(0) == a.Hq &&
                    rel->size(1) == 2 * rel_max_distance + 1 && rel_max_distance >= 0,
                "attnkit native: rel_table must be contiguous (H_q, 2*max_distance+1) "
                "= (", a.Hq, ", ", 2 * rel_max_distance + 1, "), got ", rel->sizes());
  a.bias = opt_ptr<A>(bias);
  const i64 full[4] = {a.B, a.Hq, a.Nq, a.Nk};
  if (a.bias) broadcast_strides(*bias, full, a.sb, "bias");
  a.band_lo = band_lo; a.band_hi = band_hi;
  a.kv_len = opt_ptr<int64_t>(kv_len); if (a.kv_len) a.skl = kv_len->stride(0);
  a.q_len = opt_ptr<int64_t>(q_len); if (a.q_len) a.sql = q_len->stride(0);
  a.q_doc = opt_ptr<int64_t>(q_doc); a.k_doc = opt_ptr<int64_t>(k_doc);
  if (a.q_doc)
    for (int i = 0; i < 2; ++i) { a.sqd[i] = q_doc->stride(i); a.skd[i] = k_doc->stride(i); }
  a.mask = opt_ptr<bool>(mask);
  if (a.mask) broadcast_strides(*mask, full, a.sm, "mask");
  a.NKP = round_up(a.Nk, BK);
  a.mod = reinterpret_cast<ScoreModFn<A>>(score_mod);    // addresses from score_mod.py (ctypes)
  a.mod_caps = reinterpret_cast<const void* const*>(score_mod_caps);
  return a;
}

#define ATTNKIT_DISPATCH(dtype, ...)                                                       \
  switch (dtype) {                                                                         \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                              \
    case at::kDouble: { using T = double; __VA_ARGS__; break; }                            \
    case at::kBFloat16: { using T = at::BFloat16; __VA_ARGS__; break; }                    \
    case at::kHalf: { using T = at::Half; __VA_ARGS__; break; }                            \
    default:                                                                               \
      TORCH_CHECK(false, "attnkit native: dtype ", dtype,                                  \
                  " is not supported (use float32, float64, bfloat16 or float16)");        \
  }

// The launch of a forward call: rows per item, key splits on the tile grid, and whether a
// whole head's Kᵀ is cached per thread (all threads' copies within 64 MB).
// ATTNKIT_NATIVE_HEAD_CACHE=0 turns the per-thread cache of a head's packed K / V off (a
// test switch: the code for heads too large to cache then runs at any size).
inline bool head_cache_allowed() {
  const char* e = std::getenv("ATTNKIT_NATIVE_HEAD_CACHE");
  return !(e && std::string(e) == "0");
}

// The GEMM loops' choices (T GEMMs: path(), lowp_path<T>; the head cache) are made only for
// items of 16 rows or more: the dot loops (a decode call) use neither, and skip the
// environment reads and the path's copy (a cold call's cache misses, every call).
template <typename A, typename PathFn>
void plan_forward(Args<A>& a, int64_t splits, int64_t block_q, PathFn path_of) {
  a.rows = std::max<int64_t>(1, std::min(block_q, a.Nq));
  a.n_qblocks = (a.Nq + a.rows - 1) / a.rows;
  a.splits = std::max<int64_t>(1, std::min(splits, a.Nk));
  a.split_len = round_up((a.Nk + a.splits - 1) / a.splits, BK);  // on the tile grid
  a.splits = (a.Nk + a.split_len - 1) / a.split_len;
  a.lowp = a.lowp_onednn_pack = a.lowp_emulate = a.cache_kt = false;
  if (a.G * a.rows < 16) return;                          // fewer rows: dot products (decode)
  const LowpPath path = path_of();
  a.lowp = path.gemm;
  a.lowp_onednn_pack = path.onednn_pack;
  a.lowp_emulate = path.emulate;
  const i64 head_bytes = a.lowp ? (round_up(a.Dk, 2) + round_up(a.Dv, NB)) * a.NKP * 2  // lowp.h
                                : a.Dk * a.NKP * i64(sizeof(A));
  a.cache_kt = head_cache_allowed() && head_bytes * std::max(1, at::get_num_threads()) <= (64 << 20);
}

// Forward: (out (B, H_q, N_q, D_v) in q's dtype, lse (B, H_q, N_q) in A: float32, or float64
// for float64 inputs). Screened (the operator attend_screened): also whether every query row
// the kernel gathered and every output row it wrote is finite (the eager path's NaN/inf
// screens read on the way: Args::q_bad, out_bad); the second is false too where the kernel
// did not write the final rows (a call whose keys are split: the merge writes out), and,
// under a score_mod, where a K/V row it read holds inf/NaN (Args::kv_bad) or where it did
// not screen them: it does only on the low-precision GEMM path with the head cache, where
// each tile is screened once per thread as it is packed (elsewhere every item would read
// its tiles again).
template <bool Screened>
std::conditional_t<Screened, std::tuple<Tensor, Tensor, bool, bool>, std::tuple<Tensor, Tensor>>
attend(const Tensor& q, const Tensor& k, const Tensor& v, double scale, double softcap,
       const std::optional<Tensor>& alibi, double alibi_offset, const std::optional<Tensor>& rel,
       int64_t rel_max_distance, const std::optional<Tensor>& bias, double band_lo,
       double band_hi, const std::optional<Tensor>& kv_len, const std::optional<Tensor>& q_len,
       const std::optional<Tensor>& q_doc, const std::optional<Tensor>& k_doc,
       const std::optional<Tensor>& mask, int64_t score_mod, int64_t score_mod_caps,
       int64_t splits, int64_t block_q) {
  Tensor out, lse;
  std::atomic<bool> bad[3] = {false, false, false};       // (q_bad, out_bad, kv_bad)
  bool out_read = false, kv_read = true;
  ATTNKIT_DISPATCH(q.scalar_type(), {
    using A = compute_t<T>;
    Args<A> a = make_args<A>(q, k, v, scale, softcap, alibi, alibi_offset, rel,
                             rel_max_distance, bias, band_lo, band_hi, kv_len, q_len, q_doc,
                             k_doc, mask, score_mod, score_mod_caps);
    plan_forward(a, splits, block_q, [] { return lowp_path<T>(); });
    if constexpr (Screened) {
      out_read = a.splits == 1;
      a.q_bad = &bad[0];
      a.out_bad = out_read ? &bad[1] : nullptr;
      kv_read = !a.mod || (a.lowp && a.cache_kt);
      a.kv_bad = a.mod && kv_read && out_read ? &bad[2] : nullptr;   // (split: not vouched)
    }
    out = at::empty({a.B, a.Hq, a.Nq, a.Dv}, q.options());
    lse = at::empty({a.B, a.Hq, a.Nq}, q.options().dtype(c10::CppTypeToScalarType<A>::value));
    run(a, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), out.data_ptr<T>(),
        lse.data_ptr<A>());
  });
  if constexpr (Screened)
    return {out, lse, !bad[0].load(), out_read && kv_read && !bad[1].load() && !bad[2].load()};
  else
    return {out, lse};
}

// t (4-D) with unit stride along its last dim, as the kernel reads rows: copied only when
// that dim is strided (native.unit_rows' rule, here so that the hot path's Python does not
// read three strides).
Tensor unit_rows(const Tensor& t) {
  return t.dim() == 4 && t.size(3) > 1 && t.stride(3) != 1 ? t.contiguous() : t;
}

// Whether every row of q (B, H, N, D), last dim contiguous, is finite: rows split over the
// threads from 64k elements on (a decode call's q is read inline); a thread's rows of one
// head that lie back to back (stride(2) == D: the usual layouts) are tested as one span.
template <typename T> bool input_finite(const Tensor& q) {
  const T* p = q.data_ptr<T>();
  const i64 H = q.size(1), N = q.size(2), D = q.size(3);
  const bool packed = q.stride(2) == D;
  std::atomic<bool> ok{true};
  at::parallel_for(0, q.size(0) * H * N, std::max<i64>(1, (i64(1) << 16) / std::max<i64>(D, 1)),
                   [&](i64 r0, i64 r1) {
    for (i64 r = r0; r < r1 && ok.load(std::memory_order_relaxed);) {  // rows r.. of (b, h)
      const i64 b = r / (H * N), h = r / N % H, i = r % N;
      const i64 run = packed ? std::min(r1 - r, N - i) : 1;           // rows in one span
      if (!all_finite(p + b * q.stride(0) + h * q.stride(1) + i * q.stride(2), run * D))
        ok = false;
      r += run;
    }
  });
  return ok;
}

// Whether every element of t (B, H, N, D) is finite, one pass (the eager path's NaN/inf
// screens: a score_mod's up-front K/V check, the query rows' check). Any strides; a strided
// last dim is copied first.
bool all_finite_op(const Tensor& t) {
  TORCH_CHECK(t.dim() == 4, "attnkit native: all_finite takes a 4-D tensor, got ", t.sizes());
  const Tensor r = unit_rows(t);
  bool ok = true;
  ATTNKIT_DISPATCH(r.scalar_type(), { ok = input_finite<T>(r); });
  return ok;
}

// The eager hot path's forward (a decoder's per-token call, a short prefill: attnkit/eager.py):
// no score term, a band lo <= q - k <= hi and at most a dense bool mask (B|1, H_q|1, N_q|1,
// N_k|1); the few arguments keep the dispatcher's per-call cost small; q, k, v may have a
// strided last dim (unit_rows). Returns (out, lse) as attend does and whether every output
// element (and, with check_q, every query element) is finite: the caller's NaN/inf screen.
std::tuple<Tensor, Tensor, bool> attend_lean(const Tensor& q_in, const Tensor& k_in,
                                             const Tensor& v_in, double scale, double softcap,
                                             double band_lo, double band_hi,
                                             const std::optional<Tensor>& mask, int64_t splits,
                                             int64_t block_q, bool check_q) {
  TORCH_CHECK(!mask.has_value() || mask->scalar_type() == at::kBool,
              "attnkit native: mask must be bool (True = may attend)");
  static const std::optional<Tensor> none;
  const Tensor q = unit_rows(q_in), k = unit_rows(k_in), v = unit_rows(v_in);
  auto [out, lse, q_ok, out_ok] = attend<true>(q, k, v, scale, softcap, none, 0.0, none, 0,
                                               none, band_lo, band_hi, none, none, none, none,
                                               mask, 0, 0, splits, block_q);
  if (!out_ok)                        // non-finite, or not read (split keys): one pass
    ATTNKIT_DISPATCH(q.scalar_type(), { out_ok = all_finite(out.data_ptr<T>(), out.numel()); });
  return {out, lse, out_ok && (!check_q || q_ok)};
}

// The eager hot path's per-token call (attnkit.attention): attend_lean (no mask) once the
// call's signature checks out here, in C++, against the frame's signature tensors
// (stride-0 views of one element: their sizes and dtypes are the frame's q, k, v), so
// that Python reads no shape, dtype, device or requires_grad on that path. Returns
// (out, lse, status): status 0 ran and every output (and, with check_q, every query
// element) is finite; 2 ran and something is not finite (the caller's full path screens
// K/V); 1 did not run — another shape or dtype, a tensor off the CPU, or gradients
// needed (grad mode on and an input requiring grad): out and lse are then undefined.
// (eager.SLOT_FINITE, SLOT_DECLINED, SLOT_NOT_FINITE)
enum SlotStatus : int64_t { SLOT_FINITE = 0, SLOT_DECLINED = 1, SLOT_NOT_FINITE = 2 };

std::tuple<Tensor, Tensor, int64_t> attend_slot(const Tensor& q, const Tensor& k,
                                                const Tensor& v, const Tensor& q_sig,
                                                const Tensor& k_sig, const Tensor& v_sig,
                                                double scale, double softcap, double band_lo,
                                                double band_hi, int64_t splits,
                                                int64_t block_q, bool check_q) {
  const auto fits = [](const Tensor& t, const Tensor& sig) {
    return t.device().is_cpu() && t.scalar_type() == sig.scalar_type() &&
           t.sizes() == sig.sizes();
  };
  if (!fits(q, q_sig) || !fits(k, k_sig) || !fits(v, v_sig) ||
      (c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() ||
                                       v.requires_grad())))
    return {Tensor(), Tensor(), SLOT_DECLINED};
  static const std::optional<Tensor> none;
  auto [out, lse, finite] = attend_lean(q, k, v, scale, softcap, band_lo, band_hi, none,
                                        splits, block_q, check_q);
  return {out, lse, finite ? SLOT_FINITE : SLOT_NOT_FINITE};
}

// Backward: (dq, dk, dv) like q, k, v (contiguous), d rel_table (H_q, 2M+1) in A (empty
// without a table), d alibi (H_q,) in A (empty unless alibi_grad) and d bias
// (B, H_q, N_q, N_k) in A (empty unless bias_grad; the caller sums broadcast dims); lse,
// delta in A.
// delta = rowsum(dout * out) - dlse.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attend_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const Tensor& lse,
    const Tensor& delta, double scale, double softcap, const std::optional<Tensor>& alibi,
    double alibi_offset, const std::optional<Tensor>& rel, int64_t rel_max_distance,
    const std::optional<Tensor>& bias, double band_lo, double band_hi,
    const std::optional<Tensor>& kv_len, const std::optional<Tensor>& q_len,
    const std::optional<Tensor>& q_doc, const std::optional<Tensor>& k_doc,
    const std::optional<Tensor>& mask, int64_t score_mod, int64_t score_mod_caps,
    bool alibi_grad, bool bias_grad) {
  Tensor dq, dk, dv, dtab, dslope, dbias;
  ATTNKIT_DISPATCH(q.scalar_type(), {
    using A = compute_t<T>;
    constexpr at::ScalarType kA = c10::CppTypeToScalarType<A>::value;
    Args<A> a = make_args<A>(q, k, v, scale, softcap, alibi, alibi_offset, rel,
                             rel_max_distance, bias, band_lo, band_hi, kv_len, q_len, q_doc,
                             k_doc, mask, score_mod, score_mod_caps);
    a.alibi_grad = alibi_grad && a.alibi;
    const LowpPath path = lowp_path<T>();                  // T GEMMs (backward.h), as forward
    a.lowp = path.gemm;
    a.lowp_onednn_pack = path.onednn_pack;
    a.lowp_emulate = path.emulate;
    TORCH_CHECK(dout.sizes() == at::IntArrayRef({a.B, a.Hq, a.Nq, a.Dv}) &&
                    (dout.stride(3) == 1 || dout.size(3) == 1) && dout.scalar_type() == q.scalar_type(),
                "attnkit native: dout must be like out (B, H_q, N_q, D_v), last dim "
                "contiguous");
    TORCH_CHECK(lse.is_contiguous() && delta.is_contiguous() && lse.scalar_type() == kA &&
                    delta.scalar_type() == kA,
                "attnkit native: lse and delta must be contiguous ", kA, " (B, H_q, N_q)");
    const i64 sdo[3] = {dout.stride(0), dout.stride(1), dout.stride(2)};
    dq = at::empty({a.B, a.Hq, a.Nq, a.Dk}, q.options());
    dk = at::empty({a.B, a.Hkv, a.Nk, a.Dk}, q.options());
    dv = at::empty({a.B, a.Hkv, a.Nk, a.Dv}, q.options());
    dtab = at::empty({a.rel ? a.Hq : 0, a.rel ? 2 * a.rel_M + 1 : 0}, q.options().dtype(kA));
    dslope = at::empty({a.alibi_grad ? a.Hq : 0}, q.options().dtype(kA));
    const bool bg = bias_grad && a.bias;                   // zeros: skipped tiles give 0
    dbias = bg ? at::zeros({a.B, a.Hq, a.Nq, a.Nk}, q.options().dtype(kA))
               : at::empty({0}, q.options().dtype(kA));
    a.dbias = bg ? dbias.data_ptr<A>() : nullptr;
    run_backward(a, q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), dout.data_ptr<T>(),
                 sdo, lse.data_ptr<A>(), delta.data_ptr<A>(), dq.data_ptr<T>(),
                 dk.data_ptr<T>(), dv.data_ptr<T>(), dtab.data_ptr<A>(), dslope.data_ptr<A>());
  });
  return {dq, dk, dv, dtab, dslope, dbias};
}

// ------------------------------------------------------------------ paged (paged.h)
// The sequences of a paged call, checked: cu_q (S+1,), kv_len (S,), q_pos (S,) int64
// contiguous; every block-table entry a sequence reads is a page of the pool.
std::vector<PagedSeq> paged_sequences(i64 total_q, i64 num_blocks, i64 block_size,
                                      const Tensor& table, const Tensor& cu_q,
                                      const Tensor& kv_len, const Tensor& q_pos) {
  for (const auto* t : {&table, &cu_q, &kv_len, &q_pos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(),
                "attnkit native paged: block_table, cu_seqlens_q, kv_lengths and q_positions "
                "must be int64 CPU tensors");
  TORCH_CHECK(cu_q.dim() == 1 && cu_q.is_contiguous() && cu_q.numel() >= 1,
              "attnkit native paged: cu_seqlens_q must be contiguous (S+1,)");
  const i64 S = cu_q.numel() - 1;
  TORCH_CHECK(kv_len.dim() == 1 && kv_len.numel() == S && kv_len.is_contiguous() &&
                  q_pos.dim() == 1 && q_pos.numel() == S && q_pos.is_contiguous(),
              "attnkit native paged: kv_lengths and q_positions must be contiguous (S,) = (",
              S, ",)");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == S,
              "attnkit native paged: block_table must be (S, max_pages) with S = ", S,
              ", got ", table.sizes());
  const i64* cu = cu_q.data_ptr<i64>();
  const i64* kl = kv_len.data_ptr<i64>();
  const i64* qp = q_pos.data_ptr<i64>();
  const i64* tab = table.data_ptr<i64>();
  TORCH_CHECK(cu[0] == 0 && cu[S] == total_q,
              "attnkit native paged: cu_seqlens_q must run from 0 to total_q = ", total_q,
              ", got ", cu[0], " .. ", cu[S]);
  std::vector<PagedSeq> seqs(S);
  for (i64 s = 0; s < S; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "attnkit native paged: cu_seqlens_q decreases at ", s);
    TORCH_CHECK(kl[s] >= 0, "attnkit native paged: kv_lengths[", s, "] = ", kl[s], " < 0");
    const i64 need = (kl[s] + block_size - 1) / block_size;
    TORCH_CHECK(need <= table.size(1), "attnkit native paged: sequence ", s, " has ", kl[s],
                " keys, which need ", need, " pages of ", block_size, ", but its block_table "
                "row holds only ", table.size(1));
    for (i64 j = 0; j < need; ++j) {
      const i64 p = tab[s * table.stride(0) + j * table.stride(1)];
      TORCH_CHECK(p >= 0 && p < num_blocks, "attnkit native paged: block_table[", s, ", ", j,
                  "] = ", p, " is out of range: the pool has ", num_blocks, " pages (0..",
                  num_blocks - 1, ")");
    }
    seqs[s] = PagedSeq{cu[s], cu[s + 1] - cu[s], kl[s], qp[s], 0, 0, 0, -1};
  }
  return seqs;
}

// Rows per item, key splits and the work items of each sequence (paged.h); returns the
// number of partial rows the splits need.
template <typename A>
i64 plan_paged(const Args<A>& a, std::vector<PagedSeq>& seqs, std::vector<PagedItem>& items,
               i64 split_len, i64 block_q) {
  const i64 threads = std::max(1, at::get_num_threads());
  i64 total = 0;                                           // (key, query block) visits
  for (auto& s : seqs) {
    s.rows = s.nq <= 16 ? std::max<i64>(1, s.nq) : std::max<i64>(1, block_q);
    s.nqb = (s.nq + s.rows - 1) / s.rows;
    total += a.Hkv * s.nqb * s.nk;
  }
  const bool given = split_len > 0;
  if (!given)                                              // items of <= 1/8 a thread's share
    split_len = std::max<i64>(2 * BK, (total + 8 * threads - 1) / (8 * threads));
  split_len = round_up(split_len, BK);                     // splits on the tile grid
  // a sequence on the dot loops runs its H_kv heads' items as one task (paged.h), so its
  // splits are H_kv times shorter (a task is the same share)
  const i64 dot_len = given ? split_len : round_up(std::max<i64>(2 * BK, split_len / a.Hkv), BK);
  i64 parts = 0;
  for (i64 si = 0; si < i64(seqs.size()); ++si) {
    PagedSeq& s = seqs[si];
    const i64 len = a.G * std::min(s.rows, s.nq) < 16 ? dot_len : split_len;
    s.splits = std::max<i64>(1, (s.nk + len - 1) / len);
    if (s.splits > 1) {
      s.part0 = parts;
      parts += a.Hkv * s.nqb * s.splits * a.G * s.rows;
    }
    for (i64 h = 0; h < a.Hkv; ++h)
      for (i64 qb = 0; qb < s.nqb; ++qb)
        for (i64 c = 0; c < s.splits; ++c) {
          PagedItem pi{si, h, qb, c, Item{si, h, s.pos + qb * s.rows,
                                          std::min(s.rows, s.nq - qb * s.rows), 0, 0}};
          key_range(a, pi.it, c * len, std::min(s.nk, (c + 1) * len));
          items.push_back(pi);
        }
  }
  return parts;
}

// Attention through a block table: (out (total_q, H_q, D_v) in q's dtype, lse (total_q,
// H_q) in A). See paged.h for the legend.
std::tuple<Tensor, Tensor> paged_attend(
    const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, const Tensor& block_table,
    const Tensor& cu_q, const Tensor& kv_len, const Tensor& q_pos, double scale,
    double softcap, const std::optional<Tensor>& alibi, double band_lo, double band_hi,
    int64_t split_len, int64_t block_q) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.dim() == 4,
              "attnkit native paged: q must be (total_q, H_q, D), the pools (num_blocks, "
              "block_size, H_kv, D)");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "attnkit native paged: q and the pools must share one dtype");
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "attnkit native paged: CPU tensors only");
  TORCH_CHECK((q.stride(2) == 1 || q.size(2) == 1) && (k_pool.stride(3) == 1 || k_pool.size(3) == 1) &&
                  (v_pool.stride(3) == 1 || v_pool.size(3) == 1),
              "attnkit native paged: the last dim of q and the pools must be contiguous");
  const i64 Hq = q.size(1), Hkv = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == q.size(2) && v_pool.size(0) == k_pool.size(0) &&
                  v_pool.size(1) == k_pool.size(1) && v_pool.size(2) == Hkv && Hkv > 0 &&
                  Hq % Hkv == 0 && k_pool.size(1) > 0,
              "attnkit native paged: shapes q ", q.sizes(), ", k_pool ", k_pool.sizes(),
              ", v_pool ", v_pool.sizes(), " do not fit (total_q, H_q, D), (num_blocks, "
              "block_size, H_kv, D), (num_blocks, block_size, H_kv, D_v), H_q a multiple of "
              "H_kv");
  std::vector<PagedSeq> seqs = paged_sequences(q.size(0), k_pool.size(0), k_pool.size(1),
                                               block_table, cu_q, kv_len, q_pos);
  Tensor out, lse;
  ATTNKIT_DISPATCH(q.scalar_type(), {
    using A = compute_t<T>;
    constexpr at::ScalarType kA = c10::CppTypeToScalarType<A>::value;
    Args<A> a{};
    a.B = i64(seqs.size()); a.Hq = Hq; a.Hkv = Hkv; a.G = Hq / Hkv;
    a.Dk = q.size(2); a.Dv = v_pool.size(3);
    a.DKP = round_up(a.Dk, W); a.DVP = round_up(a.Dv, W);
    a.scale = A(scale); a.softcap = A(softcap);
    a.band_lo = band_lo; a.band_hi = band_hi;
    a.NKP = BK;                                            // kt: one tile (no head cache)
    const A* slopes = nullptr;
    if (alibi.has_value()) {
      TORCH_CHECK(alibi->scalar_type() == kA && alibi->is_contiguous() && alibi->dim() == 2 &&
                      alibi->size(0) == a.B && alibi->size(1) == Hq,
                  "attnkit native paged: alibi must be contiguous ", kA, " (S, H_q) = (", a.B,
                  ", ", Hq, "), got ", alibi->scalar_type(), " ", alibi->sizes());
      slopes = alibi->data_ptr<A>();
    }
    std::vector<PagedItem> items;
    const i64 parts = plan_paged(a, seqs, items, split_len, block_q);
    // the GEMM loop's converted tiles cached per thread when all copies fit in 64 MB and
    // some sequence has several query blocks to reuse them (paged.h: TileCache; packed in
    // T on the T GEMMs, lowp.h)
    i64 tiles = 0;
    bool reuse = false, gemm_loop = false;
    for (const auto& s : seqs)
      if (a.G * std::min(s.rows, s.nq) >= 16) {
        tiles = std::max(tiles, (s.nk + BK - 1) / BK);
        reuse = reuse || s.nqb > 1;
        gemm_loop = true;
      }
    if constexpr (is_lowp<T>) {
      const LowpPath path = rows_lowp_path<T>();             // packed from the listed rows
      a.lowp = gemm_loop && path.gemm;
      a.lowp_emulate = path.emulate;
    }
    const i64 bytes = tiles * BK * (a.lowp ? (round_up(a.Dk, 2) + round_up(a.Dv, NB)) * 2
                                           : (a.Dk + a.DVP) * i64(sizeof(A)));
    a.cache_kt = reuse && head_cache_allowed() &&
                 bytes * std::max(1, at::get_num_threads()) <= (64 << 20);
    Pages<T> pg{k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), k_pool.size(1), k_pool.size(0),
                {k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)},
                {v_pool.stride(0), v_pool.stride(1), v_pool.stride(2)},
                block_table.data_ptr<i64>(), {block_table.stride(0), block_table.stride(1)}};
    const i64 sq[2] = {q.stride(0), q.stride(1)};
    out = at::empty({q.size(0), Hq, a.Dv}, q.options());
    lse = at::empty({q.size(0), Hq}, q.options().dtype(kA));
    run_paged(a, pg, q.data_ptr<T>(), sq, seqs, items, parts, slopes, out.data_ptr<T>(),
              lse.data_ptr<A>());
  });
  return {out, lse};
}

std::string vector_width() { return std::to_string(W * 32) + "-bit"; }

// x (n,) float32 rounded to bfloat16 as the low-precision forward rounds P (for the tests):
// by store_rounded (one vcvtneps2bf16 where the build has AVX512-BF16), or with generic by the
// plain vector code every build has.
Tensor round_to_bfloat16(const Tensor& x, bool generic) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1,
              "attnkit native: round_to_bfloat16 takes a 1-D float32 tensor");
  const i64 n = x.numel(), np = round_up(n, W);
  std::vector<float> in(np, 0.f);
  const Tensor xc = x.contiguous();
  std::memcpy(in.data(), xc.data_ptr<float>(), n * sizeof(float));
  Tensor out = at::empty({np}, x.options().dtype(at::kBFloat16));
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  for (i64 i = 0; i < np; i += W) {                        // values [i, i + W)
    if (generic) store_rounded_generic(o + i, load(in.data() + i));
    else store_rounded(o + i, load(in.data() + i));
  }
  return out.narrow(0, 0, n);
}

// Which GEMMs a forward call with dtype "bfloat16" / "float16" inputs runs now, and why.
std::string lowp_gemm_path(const std::string& dtype) {
  if (dtype == "bfloat16") return lowp_path<at::BFloat16>().why;
  if (dtype == "float16") return lowp_path<at::Half>().why;
  TORCH_CHECK(false, "attnkit native: lowp_gemm_path takes \"bfloat16\" or \"float16\", got ",
              dtype);
}

}  // namespace

TORCH_LIBRARY(attnkit_native, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, float scale, float softcap, Tensor? alibi, "
        "float alibi_offset, Tensor? rel_table, int rel_max_distance, Tensor? bias, "
        "float band_lo, float band_hi, Tensor? kv_len, Tensor? q_len, Tensor? q_doc, "
        "Tensor? k_doc, Tensor? mask, int score_mod, int score_mod_caps, int splits, "
        "int block_q) "
        "-> (Tensor, Tensor)",
        &attend<false>);
  m.def("attend_screened(Tensor q, Tensor k, Tensor v, float scale, float softcap, "
        "Tensor? alibi, float alibi_offset, Tensor? rel_table, int rel_max_distance, "
        "Tensor? bias, float band_lo, float band_hi, Tensor? kv_len, Tensor? q_len, "
        "Tensor? q_doc, Tensor? k_doc, Tensor? mask, int score_mod, int score_mod_caps, "
        "int splits, int block_q) "
        "-> (Tensor, Tensor, bool, bool)",
        &attend<true>);
  m.def("attend_lean(Tensor q, Tensor k, Tensor v, float scale, float softcap, float band_lo, "
        "float band_hi, Tensor? mask, int splits, int block_q, bool check_q) "
        "-> (Tensor, Tensor, bool)",
        &attend_lean);
  m.def("attend_slot(Tensor q, Tensor k, Tensor v, Tensor q_sig, Tensor k_sig, Tensor v_sig, "
        "float scale, float softcap, float band_lo, float band_hi, int splits, int block_q, "
        "bool check_q) -> (Tensor, Tensor, int)",
        &attend_slot);
  m.def("attend_backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse, Tensor delta, "
        "float scale, float softcap, Tensor? alibi, float alibi_offset, Tensor? rel_table, "
        "int rel_max_distance, Tensor? bias, float band_lo, float band_hi, Tensor? kv_len, "
        "Tensor? q_len, Tensor? q_doc, Tensor? k_doc, Tensor? mask, int score_mod, "
        "int score_mod_caps, bool alibi_grad, bool bias_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        &attend_backward);
  m.def("paged_attend(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor kv_lengths, Tensor q_positions, float scale, "
        "float softcap, Tensor? alibi, float band_lo, float band_hi, int split_len, "
        "int block_q) -> (Tensor, Tensor)",
        &paged_attend);
  m.def("all_finite(Tensor t) -> bool", &all_finite_op);
  m.def("vector_width() -> str", &vector_width);
  m.def("lowp_gemm_path(str dtype) -> str", &lowp_gemm_path);
  m.def("round_to_bfloat16(Tensor x, bool generic) -> Tensor", &round_to_bfloat16);
}

}  // namespace attnkit_native
