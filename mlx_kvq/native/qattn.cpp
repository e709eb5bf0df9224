// Fused dequantize-and-multiply for quantized attention on MLX's CPU backend.
//
// MLX's CPU `quantized_matmul` is scalar code that re-reads the packed matrix
// once per row of the left operand. Decode attention has a few rows (the
// query heads sharing one KV head) against thousands of packed key/value
// rows, so these two primitives read each packed K/V group once, unpack it
// into floats and apply it to every row with vector arithmetic:
//
//   scores:   out[b,h,m,n] = sum_d q[b,h,m,d] * K[b,h,n,d]
//   weighted: out[b,h,m,d] = sum_n p[b,h,m,n] * V[b,h,n,d]
//
// with K/V stored as MLX stores them: a little-endian bit stream of
// `bits`-wide integers per row, and a scale and a bias per `group_size`
// elements (value = scale * integer + bias). Work is split over threads by
// (sequence, head) and token ranges. CPU only: there is no GPU kernel, the
// Python side uses these primitives only on the CPU.

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/version.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace {

typedef float f8 __attribute__((vector_size(32)));
typedef _Float16 h8 __attribute__((vector_size(16)));
typedef uint16_t u16v __attribute__((vector_size(16)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVQ_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVQ_CLONES
#endif

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, f8 v) {
  std::memcpy(p, &v, sizeof(v));
}

inline float hsum(f8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef uint32_t u8v __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

// exp(x): 2^n * p(r), Cephes' degree-5 polynomial on [-ln2/2, ln2/2], relative
// error ~1e-7; 0 below -87 (-inf included), x clamped at 88.
__attribute__((always_inline)) inline f8 exp8(f8 x) {
  const f8 hi = (f8){} + 88.0f, lo = (f8){} - 87.0f;
  auto under = x < lo;
  x = x > hi ? hi : x;
  x = under ? lo : x;
  const f8 magic = (f8){} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  f8 n = (x * 1.44269504088896341f + magic) - magic;
  f8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f8 p = (f8){} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i8v e = (__builtin_convertvector(n, i8v) + 127) << 23;
  f8 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return under ? (f8){} : p * scale;
}

__attribute__((always_inline)) inline float exp1(float x) {
  f8 v = exp8((f8){} + x);
  return v[0];
}

// The largest of s[a, e) (-inf if empty).
KVQ_CLONES float range_max(const float* s, int a, int e) {
  float best = -INFINITY;
  int i = a;
  f8 vb = (f8){} - INFINITY;
  for (; i + 8 <= e; i += 8) {
    f8 v = load8(s + i);
    vb = v > vb ? v : vb;
  }
  for (int j = 0; j < 8; ++j) best = std::max(best, vb[j]);
  for (; i < e; ++i) best = std::max(best, s[i]);
  return best;
}

// o[i] = exp(s[i] - best) for i in [a, e), 0 elsewhere in [0, S) (o may be s);
// returns their sum. The sum runs over 8-lane vectors aligned to slot 0, masked
// slots adding zeros: it does not depend on how many masked slots a row has or
// where its range is cut, so every layout of the same keys computes the same.
KVQ_CLONES float exp_range(const float* s, float* o, int S, int a, int e, float best) {
  if (best == -INFINITY || e <= a) {
    std::fill(o, o + S, 0.0f);
    return 0.0f;
  }
  f8 vt = {};
  for (int i = a & ~7; i < e; i += 8) {
    if (i >= a && i + 8 <= e) {
      f8 v = exp8(load8(s + i) - best);
      store8(o + i, v);
      vt += v;
      continue;
    }
    float x[8];
    for (int j = 0; j < 8; ++j) x[j] = i + j >= a && i + j < e ? s[i + j] - best : -INFINITY;
    f8 v = exp8(load8(x));
    for (int j = 0; j < 8; ++j) {
      if (i + j >= a && i + j < e) o[i + j] = v[j];
    }
    vt += v;
  }
  std::fill(o, o + a, 0.0f);
  std::fill(o + e, o + S, 0.0f);
  return hsum(vt);
}


// The eight `bits`-wide integers in the low 8 * bits bits of `x`, as floats
// (vector shifts of broadcast words: nothing goes through memory).
template <int bits>
inline f8 from_bits(uint64_t x) {
  constexpr uint32_t mask = (1u << bits) - 1;
  u8v v;
  if constexpr (bits <= 4) {
    constexpr u8v shifts = {0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits};
    v = (((u8v){} + uint32_t(x)) >> shifts) & mask;
  } else {
    constexpr u8v shifts = {0, bits, 2 * bits, 3 * bits, 0, bits, 2 * bits, 3 * bits};
    constexpr u8v low = {~0u, ~0u, ~0u, ~0u, 0, 0, 0, 0};
    u8v lo = (u8v){} + uint32_t(x), hi = (u8v){} + uint32_t(x >> (4 * bits));
    v = (((lo & low) | (hi & ~low)) >> shifts) & mask;
  }
  return __builtin_convertvector((i8v)v, f8);
}

// Eight `bits`-wide integers (`bits` bytes of a little-endian bit stream,
// starting at a byte boundary) as floats.
template <int bits>
inline f8 unpack8(const uint8_t* src) {
  uint64_t x = 0;
  std::memcpy(&x, src, bits);
  return from_bits<bits>(x);
}

// Thirty-two integers: `bits` whole 32-bit words, read as words. Reading
// `bits` bytes per eight values (3, 5 or 6 of them) costs a partial load
// whose bytes the next load waits for; widths of 3, 5 and 6 bits ran 2.5x
// slower than 4 and 8 that way.
template <int bits>
inline void unpack32(const uint8_t* src, float* out) {
  uint32_t w[bits];
  for (int k = 0; k < bits; ++k) std::memcpy(&w[k], src + 4 * k, 4);
  for (int j = 0; j < 4; ++j) {
    const int o = 8 * j * bits, wi = o / 32;
    uint64_t x = w[wi];
    if (wi + 1 < bits) x |= uint64_t(w[wi + 1]) << 32;
    store8(out + 8 * j, from_bits<bits>(x >> (o % 32)));
  }
}

// `n` integers (a multiple of 8) from a byte boundary, as floats.
template <int bits>
inline void unpack(const uint8_t* src, int n, float* out) {
  int i = 0;
  for (; i + 32 <= n; i += 32) unpack32<bits>(src + i * bits / 8, out + i);
  for (; i < n; i += 8) store8(out + i, unpack8<bits>(src + i * bits / 8));
}

template <typename S>
inline float to_float(S x) {
  return static_cast<float>(x);
}

// Eight values of S (float32, float16 or bfloat16) as float32 lanes: one
// vector conversion (F16C in the x86-64-v3 clones), not eight scalar ones.
template <typename S>
__attribute__((always_inline)) inline f8 load8_of(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return load8(p);
  } else if constexpr (std::is_same_v<S, mx::float16_t>) {
    h8 h;
    std::memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, f8);
  } else {  // bfloat16: the high half of a float32
    u16v h;
    std::memcpy(&h, p, sizeof(h));
    u8v w = __builtin_convertvector(h, u8v) << 16;
    f8 f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
  }
}

struct Layout {
  // element strides of a 4-D input and its sizes on the two leading axes
  int64_t s0, s1, s2;
  int n0, n1;
  int64_t offset(int b, int h) const {
    return int64_t(n0 == 1 ? 0 : b) * s0 + int64_t(n1 == 1 ? 0 : h) * s1;
  }
};

Layout layout(const mx::array& a) {
  if (a.ndim() != 4) {
    throw std::invalid_argument("kvq native: inputs must be 4-D");
  }
  if (a.shape(3) > 1 && a.strides()[3] != 1) {
    throw std::invalid_argument("kvq native: the last axis must be contiguous");
  }
  return {a.strides()[0], a.strides()[1], a.strides()[2], a.shape(0), a.shape(1)};
}

// Rows of a float32 (B, H, M, X) input for one (b, h), copied when the last
// axis is not contiguous (a transposed view).
const float* rows_of(const mx::array& a, int b, int h, std::vector<float>& scratch) {
  const float* base = a.data<float>();
  auto st = a.strides();
  int64_t off = int64_t(a.shape(0) == 1 ? 0 : b) * st[0] + int64_t(a.shape(1) == 1 ? 0 : h) * st[1];
  int M = a.shape(2), X = a.shape(3);
  if (st[3] == 1 && st[2] == X) {
    return base + off;
  }
  scratch.resize(size_t(M) * X);
  for (int m = 0; m < M; ++m) {
    for (int x = 0; x < X; ++x) {
      scratch[size_t(m) * X + x] = base[off + m * st[2] + x * st[3]];
    }
  }
  return scratch.data();
}

// Threads per call: MLX_KVQ_NATIVE_THREADS, else one per core.
int max_threads() {
  static const int n = [] {
    const char* env = std::getenv("MLX_KVQ_NATIVE_THREADS");
    int v = env ? std::atoi(env) : 0;
    return v > 0 ? v : int(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

template <typename F>
void parallel_for(int n, int64_t work, F&& f) {
  // Large calls are split over threads; small ones (decode steps over short
  // caches, under 2^21 multiply-adds) run inline: there, starting threads
  // costs more, and on a machine whose cores OpenBLAS's threads still spin
  // on after a product, new threads wait for a core (docs/performance.md).
  int cores = max_threads();
  int threads = int(std::min<int64_t>({int64_t(cores), int64_t(n), work / (1 << 21) + 1}));
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) f(i);
    return;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int i = t; i < n; i += threads) f(i);
    });
  }
  for (auto& th : pool) th.join();
}

// One packed token row (D values) as floats: scale * integer + bias.
template <int bits, typename S>
inline void dequantize_row(const uint8_t* w, const S* sc, const S* bi, int D, int gs, float* out) {
  unpack<bits>(w, D, out);
  for (int g = 0; g < D / gs; ++g) {
    f8 scale = (f8){} + to_float(sc[g]);
    f8 bias = (f8){} + to_float(bi[g]);
    for (int i = g * gs; i < (g + 1) * gs; i += 8) store8(out + i, load8(out + i) * scale + bias);
  }
}

// s[m * ld] = q[m] . row for the M query rows of q (M x D floats). Always
// inlined: a call would run the default target's code inside the AVX2 clones.
__attribute__((always_inline)) inline void dot_rows(const float* q, int M, int D, const float* row, float* s, size_t ld) {
  for (int m = 0; m < M; ++m) {
    const float* qm = q + size_t(m) * D;
    f8 a0 = {}, a1 = {};
    for (int i = 0; i < D; i += 16) {
      a0 += load8(qm + i) * load8(row + i);
      a1 += load8(qm + i + 8) * load8(row + i + 8);
    }
    s[size_t(m) * ld] = hsum(a0 + a1);
  }
}

// acc[m] += p[m * ld] * row for the M rows of acc (rows acc_ld floats apart).
__attribute__((always_inline)) inline void axpy_rows(const float* p, size_t ld, int M, int D,
                                                     const float* row, float* acc, size_t acc_ld) {
  for (int m = 0; m < M; ++m) {
    float pm0 = p[size_t(m) * ld];
    if (pm0 == 0.0f) continue;
    f8 pm = (f8){} + pm0;
    float* o = acc + size_t(m) * acc_ld;
    for (int i = 0; i < D; i += 8) store8(o + i, load8(o + i) + pm * load8(row + i));
  }
}

// ---- scores: q (M x D) against packed K rows [n0, n1) -> out (M x N) --------
template <int bits, typename S>
KVQ_CLONES void scores_rows(
    const float* q, int M, int D, const uint8_t* w, int64_t w_row, const S* sc,
    const S* bi, int64_t s_row, int gs, int n0, int n1, float* out, int N) {
  alignas(32) float k[512];
  for (int n = n0; n < n1; ++n) {
    dequantize_row<bits, S>(w + n * w_row, sc + n * s_row, bi + n * s_row, D, gs, k);
    dot_rows(q, M, D, k, out + n, N);
  }
}

// ---- weighted: p (M x N) over packed V rows [n0, n1) -> acc (M x D) -----------
template <int bits, typename S>
KVQ_CLONES void weighted_rows(
    const float* p, int M, int N, int D, const uint8_t* w, int64_t w_row, const S* sc,
    const S* bi, int64_t s_row, int gs, int n0, int n1, float* acc) {
  alignas(32) float v[512];
  for (int n = n0; n < n1; ++n) {
    dequantize_row<bits, S>(w + n * w_row, sc + n * s_row, bi + n * s_row, D, gs, v);
    axpy_rows(p + n, N, M, D, v, acc, D);
  }
}

// ---- channel scores: q (M x D) against channel-major packed K -----------------
// K is stored per channel: row d holds the `bits`-wide integers of tokens
// [0, N) and a scale and a bias per `gs` tokens (KIVI). For each group of gs
// tokens: out[m, n] = sum_d (q[m,d] * scale[d,g]) * int[d,n] + sum_d q[m,d] * bias[d,g].
template <int bits, typename S>
KVQ_CLONES void channel_scores_groups(
    const float* q, int M, int D, const uint8_t* w, int64_t w_row, const S* sc, const S* bi,
    int64_t s_row, int gs, int g0, int g1, float* out, int N) {
  alignas(32) float ints[128];
  std::vector<float> acc(size_t(M) * gs);
  std::vector<float> c(M);
  for (int g = g0; g < g1; ++g) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(c.begin(), c.end(), 0.0f);
    for (int d = 0; d < D; ++d) {
      const uint8_t* row = w + d * w_row + int64_t(g) * gs * bits / 8;
      unpack<bits>(row, gs, ints);
      float scale = to_float(sc[d * s_row + g]);
      float bias = to_float(bi[d * s_row + g]);
      for (int m = 0; m < M; ++m) {
        float qd = q[size_t(m) * D + d];
        c[m] += qd * bias;
        f8 a = (f8){} + qd * scale;
        float* am = acc.data() + size_t(m) * gs;
        for (int i = 0; i < gs; i += 8) store8(am + i, load8(am + i) + a * load8(ints + i));
      }
    }
    for (int m = 0; m < M; ++m) {
      float* o = out + size_t(m) * N + int64_t(g) * gs;
      const float* am = acc.data() + size_t(m) * gs;
      for (int i = 0; i < gs; ++i) o[i] = am[i] + c[m];
    }
  }
}

template <int bits, typename S>
void run_channel(const std::vector<mx::array>& in, mx::array& out, int gs) {
  const mx::array& x = in[0];  // q (B, H, M, D) float32
  const mx::array& w = in[1];  // (B, H, D, N * bits / 32) uint32
  const mx::array& sc = in[2];  // (B, H, D, N / gs)
  const mx::array& bi = in[3];
  int B = out.shape(0), H = out.shape(1), M = out.shape(2), N = out.shape(3);
  int D = w.shape(2);
  Layout lw = layout(w), ls = layout(sc), lb = layout(bi);
  if (ls.s2 != lb.s2) {
    throw std::invalid_argument("kvq native: scales and biases must share a layout");
  }
  const uint8_t* wbase = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  const S* sbase = sc.data<S>();
  const S* bbase = bi.data<S>();
  float* obase = out.data<float>();
  int groups = N / gs;
  int cores = max_threads();
  int chunks = std::max(1, std::min({cores, groups, N / 512 + 1}));
  int tasks = B * H * chunks;
  std::vector<std::vector<float>> scratch(tasks);
  parallel_for(tasks, int64_t(B) * H * M * N * D, [&](int t) {
    int c = t % chunks, bh = t / chunks, h = bh % H, b = bh / H;
    int g0 = int(int64_t(groups) * c / chunks), g1 = int(int64_t(groups) * (c + 1) / chunks);
    const float* xr = rows_of(x, b, h, scratch[t]);
    const uint8_t* wp = wbase + lw.offset(b, h) * 4;
    const S* sp = sbase + ls.offset(b, h);
    const S* bp = bbase + lb.offset(b, h);
    float* o = obase + (size_t(b) * H + h) * M * N;
    channel_scores_groups<bits, S>(xr, M, D, wp, lw.s2 * 4, sp, bp, ls.s2, gs, g0, g1, o, N);
  });
}

enum class Kind { Scores, Weighted, ChannelScores };

template <int bits, typename S>
void run(Kind kind, const std::vector<mx::array>& in, mx::array& out, int gs) {
  const mx::array& x = in[0];  // q (B,H,M,D) or p (B,H,M,N), float32
  const mx::array& w = in[1];
  const mx::array& sc = in[2];
  const mx::array& bi = in[3];
  int B = out.shape(0), H = out.shape(1), M = out.shape(2);
  int N = w.shape(2);
  int D = int(sc.shape(3)) * gs;
  Layout lw = layout(w), ls = layout(sc), lb = layout(bi);
  if (ls.s2 != lb.s2) {
    throw std::invalid_argument("kvq native: scales and biases must share a layout");
  }
  const uint8_t* wbase = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  const S* sbase = sc.data<S>();
  const S* bbase = bi.data<S>();
  float* obase = out.data<float>();
  int64_t w_row = lw.s2 * 4;  // bytes per token row

  // Split tokens into chunks so a single (b, h) still uses every core.
  int cores = max_threads();
  int chunks = std::max(1, std::min(cores, N / 512));
  int tasks = B * H * chunks;
  // Weighted: each chunk accumulates into its own partial sums.
  std::vector<float> partial(kind == Kind::Weighted ? size_t(tasks) * M * D : 0, 0.0f);
  std::vector<std::vector<float>> scratch(tasks);
  parallel_for(tasks, int64_t(B) * H * M * N * D, [&](int t) {
    int c = t % chunks, bh = t / chunks, h = bh % H, b = bh / H;
    int n0 = int(int64_t(N) * c / chunks), n1 = int(int64_t(N) * (c + 1) / chunks);
    const float* xr = rows_of(x, b, h, scratch[t]);
    const uint8_t* wp = wbase + lw.offset(b, h) * 4;
    const S* sp = sbase + ls.offset(b, h);
    const S* bp = bbase + lb.offset(b, h);
    if (kind == Kind::Scores) {
      float* o = obase + (size_t(b) * H + h) * M * N;
      scores_rows<bits, S>(xr, M, D, wp, w_row, sp, bp, ls.s2, gs, n0, n1, o, N);
    } else {
      weighted_rows<bits, S>(xr, M, N, D, wp, w_row, sp, bp, ls.s2, gs, n0, n1,
                             partial.data() + size_t(t) * M * D);
    }
  });
  if (kind == Kind::Weighted) {
    for (int bh = 0; bh < B * H; ++bh) {
      float* o = obase + size_t(bh) * M * D;
      std::fill(o, o + size_t(M) * D, 0.0f);
      for (int c = 0; c < chunks; ++c) {
        const float* src = partial.data() + (size_t(bh) * chunks + c) * M * D;
        for (size_t i = 0; i < size_t(M) * D; ++i) o[i] += src[i];
      }
    }
  }
}

// `f.template operator()<bits>()` for a packed width known at run time (with
// `raw`, also 0: rows of S read as they are).
template <bool raw = false, typename F>
void by_bits(int bits, F&& f) {
  if constexpr (raw) {
    if (bits == 0) return f.template operator()<0>();
  }
  switch (bits) {
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    case 8: return f.template operator()<8>();
  }
  throw std::invalid_argument("kvq native: unsupported bits");
}

template <typename S>
void run_bits(Kind kind, int bits, const std::vector<mx::array>& in, mx::array& out, int gs) {
  if (kind == Kind::ChannelScores) {
    return by_bits(bits, [&]<int b>() { run_channel<b, S>(in, out, gs); });
  }
  by_bits(bits, [&]<int b>() { run<b, S>(kind, in, out, gs); });
}

// An MLX primitive that runs `run(params, inputs, out)` on the CPU stream into
// a new float32 output (every kernel here is one).
template <typename P>
class CpuKernel : public mx::Primitive {
 public:
  using Run = void (*)(const P&, const std::vector<mx::array>&, mx::array&);
  CpuKernel(mx::Stream s, const P& p, Run run, const char* name)
      : mx::Primitive(s), p_(p), run_(run), name_(name) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, p = p_, run = run_]() mutable { run(p, inputs, out); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvq native: CPU only");
  }

  const char* name() const override { return name_; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuKernel*>(&other);
    return o && o->run_ == run_ && std::memcmp(&o->p_, &p_, sizeof(p_)) == 0;
  }

 private:
  P p_;
  Run run_;
  const char* name_;
};

// Scale and bias types dispatched at run time: float16, bfloat16 or float32.
template <template <typename> class F, typename... A>
void by_scale_dtype(mx::Dtype dt, A&&... args) {
  if (dt == mx::float16) {
    F<mx::float16_t>::run(args...);
  } else if (dt == mx::bfloat16) {
    F<mx::bfloat16_t>::run(args...);
  } else {
    F<float>::run(args...);
  }
}

struct ProductParams {
  Kind kind;
  int bits, gs;
};

template <typename S>
struct RunProduct {
  static void run(const ProductParams& p, const std::vector<mx::array>& in, mx::array& out) {
    run_bits<S>(p.kind, p.bits, in, out, p.gs);
  }
};

void run_product(const ProductParams& p, const std::vector<mx::array>& in, mx::array& out) {
  by_scale_dtype<RunProduct>(in[2].dtype(), p, in, out);
}

std::shared_ptr<mx::Primitive> product(mx::Stream s, Kind kind, int bits, int gs) {
  const char* name = kind == Kind::Scores     ? "KvqPackedScores"
                     : kind == Kind::Weighted ? "KvqPackedWeighted"
                                              : "KvqChannelScores";
  return std::make_shared<CpuKernel<ProductParams>>(s, ProductParams{kind, bits, gs}, run_product,
                                                    name);
}

void check(const mx::array& x, const mx::array& w, const mx::array& s, const mx::array& b,
           int bits, int gs) {
  if (x.ndim() != 4 || w.ndim() != 4 || s.ndim() != 4 || b.ndim() != 4) {
    throw std::invalid_argument("kvq native: inputs must be 4-D (batch, heads, rows, dim)");
  }
  if (w.dtype() != mx::uint32 || s.dtype() != b.dtype()) {
    throw std::invalid_argument("kvq native: packed data must be uint32, scales and biases alike");
  }
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument("kvq native: bits must be 2, 3, 4, 5, 6 or 8");
  }
  if (gs % 16 != 0 || int64_t(s.shape(3)) * gs > 512 ||
      int64_t(w.shape(3)) * 32 != int64_t(s.shape(3)) * gs * bits) {
    throw std::invalid_argument(
        "kvq native: head dim above 512, or packed width not matching bits and group size");
  }
}

mx::array packed_scores(const mx::array& q, const mx::array& w, const mx::array& scales,
                        const mx::array& biases, int group_size, int bits) {
  check(q, w, scales, biases, bits, group_size);
  int D = scales.shape(3) * group_size;
  if (q.shape(3) != D) throw std::invalid_argument("kvq native: query width != key width");
  mx::Shape shape = {q.shape(0), q.shape(1), q.shape(2), w.shape(2)};
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32,
                   product(s, Kind::Scores, bits, group_size),
                   {mx::astype(q, mx::float32, s), w, scales, biases});
}

mx::array channel_scores(const mx::array& q, const mx::array& w, const mx::array& scales,
                         const mx::array& biases, int group_size, int bits) {
  if (q.ndim() != 4 || w.ndim() != 4 || scales.ndim() != 4 || biases.ndim() != 4) {
    throw std::invalid_argument("kvq native: inputs must be 4-D (batch, heads, rows, dim)");
  }
  if (w.dtype() != mx::uint32 || scales.dtype() != biases.dtype()) {
    throw std::invalid_argument("kvq native: packed data must be uint32, scales and biases alike");
  }
  if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
    throw std::invalid_argument("kvq native: bits must be 2, 3, 4, 5, 6 or 8");
  }
  int64_t N = int64_t(w.shape(3)) * 32 / bits;
  if (group_size % 8 != 0 || group_size > 128 || int64_t(scales.shape(3)) * group_size != N ||
      q.shape(3) != w.shape(2) || scales.shape(2) != w.shape(2)) {
    throw std::invalid_argument(
        "kvq native: channel-major keys: group size above 128, or shapes not matching");
  }
  mx::Shape shape = {q.shape(0), q.shape(1), q.shape(2), int(N)};
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32,
                   product(s, Kind::ChannelScores, bits, group_size),
                   {mx::astype(q, mx::float32, s), w, scales, biases});
}

mx::array packed_weighted(const mx::array& p, const mx::array& w, const mx::array& scales,
                          const mx::array& biases, int group_size, int bits) {
  check(p, w, scales, biases, bits, group_size);
  if (p.shape(3) != w.shape(2)) throw std::invalid_argument("kvq native: weights != tokens");
  int D = scales.shape(3) * group_size;
  mx::Shape shape = {p.shape(0), p.shape(1), p.shape(2), D};
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32,
                   product(s, Kind::Weighted, bits, group_size),
                   {mx::astype(p, mx::float32, s), w, scales, biases});
}


// ---- paged attention: rows read through block tables ------------------------
//
// Keys and values live in pools of blocks, (blocks, block, heads, packed dim);
// row b holds positions [bases[b], ends[b]), slot j in block tables[b][j / block].
// Its M query rows (n_rep heads x L positions, row r at position
// ends[b] - L + r % L) see the keys at or before their position, within
// `window` positions when window > 0. Each (row, head, token range) task
// computes its scores, a running max and sum, and the weighted values; the
// ranges are combined as in flash attention. Rows read only their own blocks.

// A layer's block pool: packed rows with their scales and biases, or (bits 0)
// raw rows of S, read in place.
struct Pool {
  const uint8_t* w;
  const void* s;
  const void* b;
  int64_t w_row;  // bytes per (token, head) row
  int64_t s_row;  // scale entries per (token, head) row
  int heads, block;
};

Pool pool_of(const mx::array& w, const mx::array& s, const mx::array& b) {
  for (auto* a : {&w, &s, &b}) {
    if (a->ndim() != 4 || !a->flags().row_contiguous) {
      throw std::invalid_argument("kvq native: block pools must be contiguous 4-D arrays");
    }
  }
  return {reinterpret_cast<const uint8_t*>(w.data<void>()), s.data<void>(), b.data<void>(),
          int64_t(w.shape(3)) * int64_t(w.itemsize()), int64_t(s.shape(3)), int(w.shape(2)),
          int(w.shape(1))};
}

// Row r of a pool as float32: dequantized into `row`, or (raw float32) in place.
template <int bits, typename S>
inline const float* pool_row(const Pool& p, int64_t r, int D, int gs, float* row) {
  if constexpr (bits == 0) {
    const S* src = reinterpret_cast<const S*>(p.w + r * p.w_row);
    if constexpr (std::is_same_v<S, float>) {
      return src;
    } else {
      for (int i = 0; i < D; i += 8) store8(row + i, load8_of(src + i));
      return row;
    }
  } else {
    const S* sc = static_cast<const S*>(p.s);
    const S* bi = static_cast<const S*>(p.b);
    dequantize_row<bits, S>(p.w + r * p.w_row, sc + r * p.s_row, bi + r * p.s_row, D, gs, row);
    return row;
  }
}

template <int bits, typename S>
KVQ_CLONES void paged_scores(const float* q, int M, int D, const Pool& k, int h, const int32_t* table,
                             int base, int p0, int p1, int gs, float* out) {
  alignas(32) float buf[512];
  for (int p = p0; p < p1; ++p) {
    int rel = p - base;
    int64_t r = (int64_t(table[rel / k.block]) * k.block + rel % k.block) * k.heads + h;
    const float* row = pool_row<bits, S>(k, r, D, gs, buf);
    dot_rows(q, M, D, row, out + (p - p0), p1 - p0);
  }
}

template <int bits, typename S>
KVQ_CLONES void paged_weighted(const float* pr, int M, int D, const Pool& v, int h,
                               const int32_t* table, int base, int p0, int p1, int gs, float* acc) {
  alignas(32) float buf[512];
  int n = p1 - p0;
  for (int p = p0; p < p1; ++p) {
    int rel = p - base;
    int64_t r = (int64_t(table[rel / v.block]) * v.block + rel % v.block) * v.heads + h;
    const float* row = pool_row<bits, S>(v, r, D, gs, buf);
    axpy_rows(pr + (p - p0), n, M, D, row, acc, D);
  }
}

template <typename S>
void paged_scores_bits(int bits, const float* q, int M, int D, const Pool& k, int h,
                       const int32_t* t, int base, int p0, int p1, int gs, float* out) {
  by_bits<true>(bits, [&]<int b>() { paged_scores<b, S>(q, M, D, k, h, t, base, p0, p1, gs, out); });
}

template <typename S>
void paged_weighted_bits(int bits, const float* p, int M, int D, const Pool& v, int h,
                         const int32_t* t, int base, int p0, int p1, int gs, float* acc) {
  by_bits<true>(bits, [&]<int b>() { paged_weighted<b, S>(p, M, D, v, h, t, base, p0, p1, gs, acc); });
}

// The per-task partial results of attention (a running max, a sum of exps
// and a weighted sum of D values per query row, `chunks` tasks per row and KV
// head, task t = (row * H + head) * chunks + chunk) combined as in flash
// attention into out (rows * H, M, D); `sinks`: one logit per query head
// (H * M / L of them), or null.
void combine_chunks(int BH, int H, int M, int L, int chunks, int D, const std::vector<float>& pmax,
                    const std::vector<float>& psum, const std::vector<float>& pacc,
                    const float* sinks, float* ob) {
  for (int bh = 0; bh < BH; ++bh) {
    int h = bh % H;
    for (int m = 0; m < M; ++m) {
      float best = -INFINITY;
      for (int c = 0; c < chunks; ++c) best = std::max(best, pmax[(size_t(bh) * chunks + c) * M + m]);
      float sink = sinks ? sinks[h * (M / L) + m / L] : -INFINITY;
      float top = std::max(best, sink);
      float total = sinks ? exp1(sink - top) : 0.0f;
      float* o = ob + (size_t(bh) * M + m) * D;
      std::fill(o, o + D, 0.0f);
      for (int c = 0; c < chunks; ++c) {
        size_t t = size_t(bh) * chunks + c;
        float mc = pmax[t * M + m];
        if (mc == -INFINITY) continue;
        float w = exp1(mc - top);
        total += w * psum[t * M + m];
        const float* a = pacc.data() + (t * M + m) * D;
        for (int d = 0; d < D; ++d) o[d] += w * a[d];
      }
      float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

struct PagedParams {
  int L, window, kbits, kgs, vbits, vgs;
  bool sinks;
};

template <typename S>
void run_paged(const PagedParams& pp, const std::vector<mx::array>& in, mx::array& out) {
  const mx::array& q = in[0];  // (B, H, M, Dk) float32, contiguous
  Pool kp = pool_of(in[1], in[2], in[3]);
  Pool vp = pool_of(in[4], in[5], in[6]);
  const mx::array& tables = in[7];  // (B, T) int32
  const int32_t* bases = in[8].data<int32_t>();
  const int32_t* ends = in[9].data<int32_t>();
  const float* sinks = in[10].data<float>();  // (H * M / L) per query head
  int B = q.shape(0), H = q.shape(1), M = q.shape(2), Dk = q.shape(3);
  int Dv = out.shape(3);
  int T = tables.shape(1);
  const int32_t* tb = tables.data<int32_t>();
  const float* qb = q.data<float>();
  float* ob = out.data<float>();
  int L = pp.L;

  // The key range each row's queries can see, and the chunks it is split in.
  std::vector<int> lo(B), hi(B);
  int longest = 0;
  for (int b = 0; b < B; ++b) {
    hi[b] = ends[b];
    lo[b] = bases[b];
    if (pp.window > 0) lo[b] = std::max(lo[b], ends[b] - L - pp.window + 1);
    longest = std::max(longest, hi[b] - lo[b]);
  }
  int chunks = std::max(1, std::min(max_threads(), longest / 512));
  int tasks = B * H * chunks;
  std::vector<float> pmax(size_t(tasks) * M), psum(size_t(tasks) * M);
  std::vector<float> pacc(size_t(tasks) * M * Dv);
  int64_t work = 0;
  for (int b = 0; b < B; ++b) work += int64_t(hi[b] - lo[b]) * H * M * (Dk + Dv);
  parallel_for(tasks, work, [&](int t) {
    int c = t % chunks, bh = t / chunks, h = bh % H, b = bh / H;
    int n_all = hi[b] - lo[b];
    int p0 = lo[b] + int(int64_t(n_all) * c / chunks);
    int p1 = lo[b] + int(int64_t(n_all) * (c + 1) / chunks);
    float* mx_ = pmax.data() + size_t(t) * M;
    float* sm = psum.data() + size_t(t) * M;
    float* acc = pacc.data() + size_t(t) * M * Dv;
    std::fill(acc, acc + size_t(M) * Dv, 0.0f);
    int n = p1 - p0;
    if (n <= 0) {
      std::fill(mx_, mx_ + M, -INFINITY);
      std::fill(sm, sm + M, 0.0f);
      return;
    }
    const float* qr = qb + (size_t(b) * H + h) * M * Dk;
    const int32_t* table = tb + size_t(b) * T;
    std::vector<float> s(size_t(M) * n);
    paged_scores_bits<S>(pp.kbits, qr, M, Dk, kp, h, table, bases[b], p0, p1, pp.kgs, s.data());
    for (int m = 0; m < M; ++m) {
      int qpos = ends[b] - L + m % L;
      int e = std::clamp(qpos - p0 + 1, 0, n);
      int a = pp.window > 0 ? std::clamp(qpos - pp.window + 1 - p0, 0, e) : 0;
      float* sr = s.data() + size_t(m) * n;
      float best = range_max(sr, a, e);
      mx_[m] = best;
      sm[m] = exp_range(sr, sr, n, a, e, best);
    }
    paged_weighted_bits<S>(pp.vbits, s.data(), M, Dv, vp, h, table, bases[b], p0, p1, pp.vgs, acc);
  });
  combine_chunks(B * H, H, M, L, chunks, Dv, pmax, psum, pacc, pp.sinks ? sinks : nullptr, ob);
}

template <typename S>
struct RunPaged {
  static void run(const PagedParams& p, const std::vector<mx::array>& in, mx::array& out) {
    run_paged<S>(p, in, out);
  }
};

void run_paged_any(const PagedParams& p, const std::vector<mx::array>& in, mx::array& out) {
  // the raw rows' dtype, or the scales'
  by_scale_dtype<RunPaged>((p.kbits == 0 ? in[1] : in[2]).dtype(), p, in, out);
}

mx::array paged_attention(const mx::array& q, const mx::array& kw, const mx::array& ks,
                          const mx::array& kb, const mx::array& vw, const mx::array& vs,
                          const mx::array& vb, const mx::array& tables, const mx::array& bases,
                          const mx::array& ends, const mx::array& sinks, int L, int window,
                          int kbits, int kgs, int vbits, int vgs, bool has_sinks) {
  auto s = mx::default_stream(mx::Device::cpu);
  if (q.ndim() != 4 || tables.ndim() != 2 || tables.dtype() != mx::int32 ||
      bases.dtype() != mx::int32 || ends.dtype() != mx::int32) {
    throw std::invalid_argument("kvq native: q (B,H,M,D), int32 tables (B,T), bases and ends (B)");
  }
  int Dk, Dv;
  if (kbits == 0 || vbits == 0) {  // raw pools: rows of float32, float16 or bfloat16
    Dk = kw.shape(3), Dv = vw.shape(3);
    auto dt = kw.dtype();
    if (kbits != vbits || vw.dtype() != dt ||
        (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16)) {
      throw std::invalid_argument("kvq native: raw key and value pools must share a float dtype");
    }
    if (q.shape(3) != Dk || Dk > 512 || Dv > 512 || Dk % 16 || Dv % 8 || q.shape(2) % L) {
      throw std::invalid_argument("kvq native: raw paged shapes unsupported");
    }
  } else {
    if (ks.dtype() != vs.dtype() || kb.dtype() != ks.dtype() || vb.dtype() != vs.dtype()) {
      throw std::invalid_argument("kvq native: key and value scales must share a dtype");
    }
    for (int bits : {kbits, vbits}) {
      if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
        throw std::invalid_argument("kvq native: bits must be 0, 2, 3, 4, 5, 6 or 8");
      }
    }
    Dk = ks.shape(3) * kgs, Dv = vs.shape(3) * vgs;
    if (q.shape(3) != Dk || Dk > 512 || Dv > 512 || kgs % 16 || vgs % 16 ||
        int64_t(kw.shape(3)) * 32 != int64_t(Dk) * kbits ||
        int64_t(vw.shape(3)) * 32 != int64_t(Dv) * vbits || q.shape(2) % L) {
      throw std::invalid_argument("kvq native: paged shapes do not match bits and group sizes");
    }
  }
  mx::Shape shape = {q.shape(0), q.shape(1), q.shape(2), Dv};
  PagedParams p{L, window, kbits, kgs, vbits, vgs, has_sinks};
  auto c = [&](const mx::array& a) { return mx::contiguous(a, false, s); };
  auto kernel = std::make_shared<CpuKernel<PagedParams>>(s, p, run_paged_any, "KvqPagedAttention");
  return mx::array(shape, mx::float32, kernel,
                   {c(mx::astype(q, mx::float32, s)), c(kw), c(ks), c(kb), c(vw), c(vs), c(vb),
                    c(tables), c(bases), c(ends), c(mx::astype(sinks, mx::float32, s))});
}

// ---- the split layout in blocks: exact sinks and tails beside the pool -----
//
// Row b holds positions [0, ends[b]): blocks tables[b][0 .. nblocks[b]) for
// [0, nblocks[b] * block), quantized once in the body's basis (keys per
// channel, `(blocks, heads, dim, block * bits / 32)`, or per token as `Pool`;
// values per token), then its exact tail [nblocks[b] * block, ends[b]): the
// first slots of row b of the batch's 16-bit tail buffer `(B, heads, capacity,
// dim)`. Its exact sinks, `(1, heads, n, dim)`, when it has them,
// stand in for the first slots of its first block. The body is read with
// `qb` (the queries in the body's basis), the exact rows with `q`; with
// rotated values the body's share of the output is kept apart (the second
// half of each output row) for the caller to rotate back.

// One head's exact tokens of one row: n rows of S, read in place.
template <typename S>
struct Exact {
  const S* k;
  const S* v;
  int n;
};

// Row `row` (D values of S) as float32 into `buf`, or in place for float32.
template <typename S>
__attribute__((always_inline)) inline const float* exact_row(const S* row, int D, float* buf) {
  if constexpr (std::is_same_v<S, float>) {
    return row;
  } else {
    for (int i = 0; i < D; i += 8) store8(buf + i, load8_of(row + i));
    return buf;
  }
}

// Scores of exact rows [t0, t1) of one head against M queries, into columns
// col0.. of s (M x ld); and their weighted sum into acc (M x D). Each row is
// converted once for all M queries.
template <typename S>
KVQ_CLONES void exact_scores(const float* q, int M, int D, const S* rows, int t0, int t1, float* s,
                             int ld, int col0) {
  alignas(32) float buf[512];
  for (int t = t0; t < t1; ++t) {
    const float* r = exact_row(rows + size_t(t) * D, D, buf);
    dot_rows(q, M, D, r, s + col0 + t - t0, ld);
  }
}

template <typename S>
KVQ_CLONES void exact_weighted(const float* p, int M, int D, const S* rows, int t0, int t1, int ld,
                               int col0, float* acc, int acc_ld) {
  alignas(32) float buf[512];
  for (int t = t0; t < t1; ++t) {
    const float* r = exact_row(rows + size_t(t) * D, D, buf);
    axpy_rows(p + col0 + t - t0, ld, M, D, r, acc, acc_ld);
  }
}

// Scores of one block's slots [a, block) through a token-major pool.
template <int bits, typename S>
KVQ_CLONES void block_token_scores(const float* q, int M, int D, const Pool& k, int h, int64_t blk,
                                   int a, int gs, float* s, int ld, int col0) {
  alignas(32) float buf[512];
  for (int j = a; j < k.block; ++j) {
    int64_t r = (blk * k.block + j) * k.heads + h;
    const float* row = pool_row<bits, S>(k, r, D, gs, buf);
    dot_rows(q, M, D, row, s + col0 + j, ld);
  }
}

template <int bits, typename S>
KVQ_CLONES void block_weighted(const float* p, int M, int D, const Pool& v, int h, int64_t blk,
                               int a, int gs, int ld, int col0, float* acc, int acc_ld) {
  alignas(32) float buf[512];
  for (int j = a; j < v.block; ++j) {
    int64_t r = (blk * v.block + j) * v.heads + h;
    const float* row = pool_row<bits, S>(v, r, D, gs, buf);
    axpy_rows(p + col0 + j, ld, M, D, row, acc, acc_ld);
  }
}

// A per-channel key pool: (blocks, heads, dim, block * bits / 32) words and
// (blocks, heads, dim, block / gs) scales and biases.
struct ChannelPool {
  const uint8_t* w;
  const void* s;
  const void* b;
  int64_t w_row;  // bytes per channel row of a block
  int64_t s_row;  // scale entries per channel row of a block
  int heads, dim;
};

template <int bits, typename S>
void block_channel_scores(const float* q, int M, const ChannelPool& k, int h, int64_t blk, int block,
                          int gs, float* s, int ld, int col0) {
  int64_t row0 = (blk * k.heads + h) * k.dim;
  channel_scores_groups<bits, S>(q, M, k.dim, k.w + row0 * k.w_row, k.w_row,
                                 static_cast<const S*>(k.s) + row0 * k.s_row,
                                 static_cast<const S*>(k.b) + row0 * k.s_row, k.s_row, gs, 0,
                                 block / gs, s + col0, ld);
}

struct SplitParams {
  int L, block, kbits, kgs, vbits, vgs;
  bool channel, sinks, apart;
};

template <int bits, typename S>
void key_block_any(const SplitParams& pp, const float* q, int M, int D, const Pool& kp,
                   const ChannelPool& kc, int h, int64_t blk, float* s, int ld, int col0) {
  if (pp.channel) {
    block_channel_scores<bits, S>(q, M, kc, h, blk, pp.block, pp.kgs, s, ld, col0);
  } else {
    block_token_scores<bits, S>(q, M, D, kp, h, blk, 0, pp.kgs, s, ld, col0);
  }
}

template <typename S>
void key_block(const SplitParams& pp, const float* q, int M, int D, const Pool& kp,
               const ChannelPool& kc, int h, int64_t blk, float* s, int ld, int col0) {
  by_bits(pp.kbits, [&]<int b>() { key_block_any<b, S>(pp, q, M, D, kp, kc, h, blk, s, ld, col0); });
}

template <typename S>
void value_block(int bits, const float* p, int M, int D, const Pool& v, int h, int64_t blk, int a,
                 int gs, int ld, int col0, float* acc, int acc_ld) {
  by_bits(bits, [&]<int b>() { block_weighted<b, S>(p, M, D, v, h, blk, a, gs, ld, col0, acc, acc_ld); });
}

// inputs: q, qb (B, H, M, Dk) float32; kw, ks, kb; vw, vs, vb; tables (B, T),
// nblocks (B), ends (B) int32; sinks (H * M / L) float32; then per row its
// exact sink keys and values (1, H, n, D) of S; then the tail key and value
// buffers (B, H, capacity, D) of S.
template <typename S>
void run_split(const SplitParams& pp, const std::vector<mx::array>& in, mx::array& out) {
  const mx::array& q = in[0];
  const float* qa = q.data<float>();
  const float* qba = in[1].data<float>();
  Pool kp{}, vp = pool_of(in[5], in[6], in[7]);
  ChannelPool kc{};
  if (pp.channel) {
    kc = {reinterpret_cast<const uint8_t*>(in[2].data<void>()), in[3].data<void>(),
          in[4].data<void>(), int64_t(in[2].shape(3)) * int64_t(in[2].itemsize()),
          int64_t(in[3].shape(3)), int(in[2].shape(1)), int(in[2].shape(2))};
  } else {
    kp = pool_of(in[2], in[3], in[4]);
  }
  const int32_t* tb = in[8].data<int32_t>();
  const int32_t* nblocks = in[9].data<int32_t>();
  const int32_t* ends = in[10].data<int32_t>();
  const float* asinks = in[11].data<float>();
  int B = q.shape(0), H = q.shape(1), M = q.shape(2), Dk = q.shape(3);
  int T = in[8].shape(1);
  int Dv = vp.w_row * 8 / pp.vbits;
  int Do = out.shape(3);  // Dv, or 2 * Dv with the body's share apart
  int bs = pp.block, L = pp.L;
  auto sink_rows = [&](int b, int h) -> Exact<S> {
    const mx::array& k = in[12 + 2 * b];
    const mx::array& v = in[12 + 2 * b + 1];
    int n = k.shape(2);
    if (n == 0) return {nullptr, nullptr, 0};
    return {k.data<S>() + size_t(h) * n * Dk, v.data<S>() + size_t(h) * n * Dv, n};
  };
  const mx::array& tk = in[12 + 2 * B];
  const mx::array& tv = in[13 + 2 * B];
  int cap = tk.shape(2);
  auto tail_rows = [&](int b, int h, int n) -> Exact<S> {
    if (n == 0) return {nullptr, nullptr, 0};
    size_t row = (size_t(b) * H + h) * cap;
    return {tk.data<S>() + row * Dk, tv.data<S>() + row * Dv, n};
  };
  int longest = 0;
  for (int b = 0; b < B; ++b) longest = std::max(longest, int(ends[b]));
  int chunks = std::max(1, std::min(max_threads(), longest / 1024));
  int tasks = B * H * chunks;
  std::vector<float> pmax(size_t(tasks) * M), psum(size_t(tasks) * M);
  std::vector<float> pacc(size_t(tasks) * M * Do);
  int64_t work = 0;
  for (int b = 0; b < B; ++b) work += int64_t(ends[b]) * H * M * (Dk + Dv);
  parallel_for(tasks, work, [&](int t) {
    int c = t % chunks, bh = t / chunks, h = bh % H, b = bh / H;
    int nb = nblocks[b], j0 = int(int64_t(nb) * c / chunks), j1 = int(int64_t(nb) * (c + 1) / chunks);
    bool last = c == chunks - 1;
    int P0 = j0 * bs, P1 = last ? ends[b] : j1 * bs, n = P1 - P0;
    float* mx_ = pmax.data() + size_t(t) * M;
    float* sm = psum.data() + size_t(t) * M;
    float* acc = pacc.data() + size_t(t) * M * Do;
    float* body = pp.apart ? acc + Dv : acc;
    std::fill(acc, acc + size_t(M) * Do, 0.0f);
    if (n <= 0) {
      std::fill(mx_, mx_ + M, -INFINITY);
      std::fill(sm, sm + M, 0.0f);
      return;
    }
    const float* qr = qa + (size_t(b) * H + h) * M * Dk;
    const float* qbr = qba + (size_t(b) * H + h) * M * Dk;
    const int32_t* table = tb + size_t(b) * T;
    Exact<S> sink = sink_rows(b, h), tail = tail_rows(b, h, ends[b] - nb * bs);
    int sn = nb > 0 ? sink.n : 0;  // before a first block, the sinks are in the tail
    std::vector<float> s(size_t(M) * n);
    for (int j = j0; j < j1; ++j) {
      key_block<S>(pp, qbr, M, Dk, kp, kc, h, table[j], s.data(), n, (j - j0) * bs);
    }
    if (j0 == 0 && sn) exact_scores<S>(qr, M, Dk, sink.k, 0, sn, s.data(), n, 0);
    int tl = nb * bs;
    if (last && tail.n) exact_scores<S>(qr, M, Dk, tail.k, 0, tail.n, s.data(), n, tl - P0);
    for (int m = 0; m < M; ++m) {
      int qpos = ends[b] - L + m % L;
      int e = std::clamp(qpos - P0 + 1, 0, n);
      float* sr = s.data() + size_t(m) * n;
      float best = range_max(sr, 0, e);
      mx_[m] = best;
      sm[m] = exp_range(sr, sr, n, 0, e, best);
    }
    for (int j = j0; j < j1; ++j) {
      int a = j == 0 ? sn : 0;
      value_block<S>(pp.vbits, s.data(), M, Dv, vp, h, table[j], a, pp.vgs, n, (j - j0) * bs,
                     body, Do);
    }
    if (j0 == 0 && sn) exact_weighted<S>(s.data(), M, Dv, sink.v, 0, sn, n, 0, acc, Do);
    if (last && tail.n) exact_weighted<S>(s.data(), M, Dv, tail.v, 0, tail.n, n, tl - P0, acc, Do);
  });
  combine_chunks(B * H, H, M, L, chunks, Do, pmax, psum, pacc, pp.sinks ? asinks : nullptr,
                 out.data<float>());
}

template <typename S>
struct RunSplit {
  static void run(const SplitParams& p, const std::vector<mx::array>& in, mx::array& out) {
    run_split<S>(p, in, out);
  }
};

void run_split_any(const SplitParams& p, const std::vector<mx::array>& in, mx::array& out) {
  by_scale_dtype<RunSplit>(in[3].dtype(), p, in, out);
}

mx::array paged_split_attention(const mx::array& q, const mx::array& qb, const mx::array& kw,
                                const mx::array& ks, const mx::array& kb, const mx::array& vw,
                                const mx::array& vs, const mx::array& vb, const mx::array& tables,
                                const mx::array& nblocks, const mx::array& ends,
                                const mx::array& sinks, const std::vector<mx::array>& exact,
                                int L, int block, int kbits, int kgs, int vbits, int vgs,
                                bool channel, bool has_sinks, bool apart) {
  auto s = mx::default_stream(mx::Device::cpu);
  int B = q.ndim() == 4 ? q.shape(0) : 0;
  if (q.ndim() != 4 || qb.shape() != q.shape() || tables.ndim() != 2 ||
      tables.dtype() != mx::int32 || nblocks.dtype() != mx::int32 || ends.dtype() != mx::int32 ||
      int(exact.size()) != 2 * B + 2 || q.shape(2) % L) {
    throw std::invalid_argument(
        "kvq native: q, qb (B,H,M,D), int32 tables (B,T), nblocks and ends (B), 2 sink parts per "
        "row and 2 tail buffers");
  }
  auto sd = ks.dtype();
  if (vs.dtype() != sd || kb.dtype() != sd || vb.dtype() != sd) {
    throw std::invalid_argument("kvq native: key and value scales must share a dtype");
  }
  for (int bits : {kbits, vbits}) {
    if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) {
      throw std::invalid_argument("kvq native: bits must be 2, 3, 4, 5, 6 or 8");
    }
  }
  int Dk = q.shape(3), Dv = vs.shape(3) * vgs, H = q.shape(1);
  bool keys_ok = channel ? (kw.ndim() == 4 && kw.shape(1) == H && kw.shape(2) == Dk &&
                            int64_t(kw.shape(3)) * 32 == int64_t(block) * kbits &&
                            ks.shape(3) * kgs == block && kgs <= 128 && kgs % 8 == 0)
                         : (kw.ndim() == 4 && kw.shape(1) == block && kw.shape(2) == H &&
                            ks.shape(3) * kgs == Dk && kgs % 16 == 0 &&
                            int64_t(kw.shape(3)) * 32 == int64_t(Dk) * kbits);
  if (!keys_ok || Dk > 512 || Dv > 512 || Dk % 16 || Dv % 8 || vgs % 16 || vw.shape(1) != block ||
      int64_t(vw.shape(3)) * 32 != int64_t(Dv) * vbits) {
    throw std::invalid_argument("kvq native: paged split shapes do not match bits and group sizes");
  }
  for (int i = 0; i < 2 * B + 2; ++i) {
    const auto& a = exact[i];
    int D = i % 2 ? Dv : Dk;
    int rows = i < 2 * B ? 1 : B;
    if (a.ndim() != 4 || a.shape(0) != rows || a.shape(1) != H || a.shape(3) != D ||
        (a.size() && a.dtype() != sd)) {
      throw std::invalid_argument(
          "kvq native: sinks must be (1, H, n, D), tail buffers (B, H, capacity, D), in the "
          "scales' dtype");
    }
  }
  if (exact[2 * B].shape(2) != exact[2 * B + 1].shape(2)) {
    throw std::invalid_argument("kvq native: the tail buffers must share a capacity");
  }
  mx::Shape shape = {q.shape(0), H, q.shape(2), apart ? 2 * Dv : Dv};
  SplitParams p{L, block, kbits, kgs, vbits, vgs, channel, has_sinks, apart};
  auto c = [&](const mx::array& a) { return mx::contiguous(a, false, s); };
  std::vector<mx::array> in = {c(mx::astype(q, mx::float32, s)), c(mx::astype(qb, mx::float32, s)),
                               c(kw), c(ks), c(kb), c(vw), c(vs), c(vb), c(tables), c(nblocks),
                               c(ends), c(mx::astype(sinks, mx::float32, s))};
  for (const auto& a : exact) in.push_back(c(a));
  auto kernel =
      std::make_shared<CpuKernel<SplitParams>>(s, p, run_split_any, "KvqPagedSplitAttention");
  return mx::array(shape, mx::float32, kernel, std::move(in));
}

// -- causal softmax ----------------------------------------------------------
//
// Softmax of attention scores under a causal (optionally windowed) mask given
// by positions, with optional sinks: what prefill needs between its two
// products. MLX's CPU softmax computes exp one element at a time (~16 ns per
// score here) and the mask is another pass over the matrix; this one reads
// each row once for its maximum and once for exp, with a vector exp.
//
// scores (B, H, R, S): R = n_rep * rows query rows per KV head, rows of query
// head h * n_rep + r / rows; query row r sees key slot i iff
// shift[b] + m - window < i <= shift[b] + m (window 0: no lower bound), where
// m = r % rows.

struct SoftmaxParams {
  int rows, window, n_rep;
  bool sinks;
};

KVQ_CLONES void softmax_row(const float* s, float* o, int S, int a, int e, float sink,
                            bool has_sink) {
  float best = std::max(has_sink ? sink : -INFINITY, range_max(s, a, e));
  float total = exp_range(s, o, S, a, e, best);
  if (best == -INFINITY) return;  // every score masked out (and no sink)
  if (has_sink) total += exp1(sink - best);
  f8 inv = (f8){} + 1.0f / total;
  int i = a;
  for (; i + 8 <= e; i += 8) store8(o + i, load8(o + i) * inv);
  for (; i < e; ++i) o[i] *= inv[0];
}

void run_softmax(const SoftmaxParams& p, const std::vector<mx::array>& in, mx::array& out) {
  const mx::array& sc = in[0];
  const int32_t* shift = in[1].data<int32_t>();
  const float* sinks = in[2].data<float>();
  int B = sc.shape(0), H = sc.shape(1), R = sc.shape(2), S = sc.shape(3);
  const float* sb = sc.data<float>();
  float* ob = out.data<float>();
  int shifts = in[1].size();
  int64_t work = int64_t(B) * H * R * S / 8;
  parallel_for(B * H, work, [&](int bh) {
    int b = bh / H, h = bh % H;
    int sh = shift[shifts == 1 ? 0 : b];
    for (int r = 0; r < R; ++r) {
      int m = r % p.rows;
      int last = sh + m;  // the last key slot this query sees
      int e = std::min(S, std::max(0, last + 1));
      int a = p.window > 0 ? std::min(e, std::max(0, last - p.window + 1)) : 0;
      size_t off = (size_t(bh) * R + r) * S;
      float sink = p.sinks ? sinks[h * p.n_rep + r / p.rows] : 0.0f;
      softmax_row(sb + off, ob + off, S, a, e, sink, p.sinks);
    }
  });
}

mx::array causal_softmax(const mx::array& scores, const mx::array& shift, const mx::array& sinks,
                         int rows, int window, int n_rep, bool has_sinks) {
  auto s = mx::default_stream(mx::Device::cpu);
  if (scores.ndim() != 4 || shift.dtype() != mx::int32 || shift.ndim() != 1 ||
      (shift.size() != 1 && int(shift.size()) != scores.shape(0)) || rows <= 0 || n_rep <= 0 ||
      scores.shape(2) != rows * n_rep || window < 0) {
    throw std::invalid_argument(
        "kvq native: scores (B, H, n_rep * rows, S), int32 shift (1 or B), window >= 0");
  }
  if (has_sinks && int(sinks.size()) < scores.shape(1) * n_rep) {
    throw std::invalid_argument("kvq native: one sink per query head");
  }
  SoftmaxParams p{rows, window, n_rep, has_sinks};
  auto c = [&](const mx::array& a) { return mx::contiguous(a, false, s); };
  auto kernel = std::make_shared<CpuKernel<SoftmaxParams>>(s, p, run_softmax, "KvqCausalSoftmax");
  return mx::array(scores.shape(), mx::float32, kernel,
                   {c(mx::astype(scores, mx::float32, s)), c(shift),
                    c(mx::astype(sinks, mx::float32, s))});
}

// Log-softmax of each row of a (N, V) float32 matrix: the normalization of
// the logits in every decode step of mlx-lm's batch, over vocabularies of
// 10^5 entries per row, where MLX's CPU exp is scalar (~9 ns an element:
// 49 ms of a 244 ms step at 16 rows of Gemma 3's 262,144 logits).

KVQ_CLONES void log_softmax_row(const float* s, float* o, int V) {
  float best = range_max(s, 0, V);
  float shift = best + std::log(exp_range(s, o, V, 0, V, best));  // o: scratch
  f8 sh = (f8){} + shift;
  int i = 0;
  for (; i + 8 <= V; i += 8) store8(o + i, load8(s + i) - sh);
  for (; i < V; ++i) o[i] = s[i] - shift;
}

struct RowsParams {
  int unused;
};

void run_log_softmax(const RowsParams&, const std::vector<mx::array>& in, mx::array& out) {
  const mx::array& x = in[0];
  int N = x.shape(0), V = x.shape(1);
  const float* xb = x.data<float>();
  float* ob = out.data<float>();
  parallel_for(N, int64_t(N) * V / 8, [&](int r) {
    log_softmax_row(xb + size_t(r) * V, ob + size_t(r) * V, V);
  });
}

mx::array log_softmax(const mx::array& x) {
  auto s = mx::default_stream(mx::Device::cpu);
  if (x.ndim() != 2) throw std::invalid_argument("kvq native: log_softmax of (N, V) rows");
  auto kernel = std::make_shared<CpuKernel<RowsParams>>(s, RowsParams{0}, run_log_softmax,
                                                        "KvqLogSoftmax");
  return mx::array(x.shape(), mx::float32, kernel,
                   {mx::contiguous(mx::astype(x, mx::float32, s), false, s)});
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Fused dequantize-and-multiply kernels for quantized attention (MLX CPU backend)";
  // The MLX this was compiled against: the C++ API has no stable ABI, so the
  // Python side uses the kernels only under the same MLX version.
  std::string built = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);
  m.attr("built_for_mlx") = nb::str(built.c_str());
  m.def("packed_scores", &packed_scores, "q"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "float32 q @ K^T with K packed (B, H, N, D*bits/32); (B, H, M, N)");
  m.def("channel_scores", &channel_scores, "q"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "float32 q @ K^T with K channel-major (B, H, D, N*bits/32), scales per group of tokens");
  m.def("packed_weighted", &packed_weighted, "p"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "float32 p @ V with V packed (B, H, N, D*bits/32); (B, H, M, D)");
  m.def("paged_attention", &paged_attention, "q"_a, "kw"_a, "ks"_a, "kb"_a, "vw"_a, "vs"_a,
        "vb"_a, "tables"_a, "bases"_a, "ends"_a, "sinks"_a, "L"_a, "window"_a, "kbits"_a,
        "kgs"_a, "vbits"_a, "vgs"_a, "has_sinks"_a,
        "float32 attention of q (B, H, M, Dk) over block pools read through block tables "
        "(bits 0: raw pools, passed as kw/ks/kb and vw/vs/vb alike)");
  m.def("paged_split_attention", &paged_split_attention, "q"_a, "qb"_a, "kw"_a, "ks"_a, "kb"_a,
        "vw"_a, "vs"_a, "vb"_a, "tables"_a, "nblocks"_a, "ends"_a, "sinks"_a, "exact"_a, "L"_a,
        "block"_a, "kbits"_a, "kgs"_a, "vbits"_a, "vgs"_a, "channel"_a, "has_sinks"_a, "apart"_a,
        "float32 attention of q (B, H, M, Dk) over split-layout rows: block pools read through "
        "block tables (keys per channel or per token, in the body's basis: qb), and each row's "
        "exact sinks and tail (exact: sink keys, sink values per row, then the tail key and value "
        "buffers)");
  m.def("causal_softmax", &causal_softmax, "scores"_a, "shift"_a, "sinks"_a, "rows"_a,
        "window"_a, "n_rep"_a, "has_sinks"_a,
        "float32 softmax of scores (B, H, n_rep * rows, S) under a causal mask by positions: "
        "row r sees key slots (shift + m - window, shift + m], m = r % rows");
  m.def("log_softmax", &log_softmax, "x"_a, "float32 log-softmax of each row of x (N, V)");
}
