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

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
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

// Eight `bits`-wide integers (`bits` bytes of a little-endian bit stream,
// starting at a byte boundary) as floats.
template <int bits>
inline f8 unpack8(const uint8_t* src) {
  constexpr uint32_t mask = (1u << bits) - 1;
  u8v v;
  if constexpr (bits <= 4) {
    constexpr u8v shifts = {0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits};
    uint32_t x = 0;
    std::memcpy(&x, src, bits);
    v = (((u8v){} + x) >> shifts) & mask;
  } else {
    constexpr u8v shifts = {0, bits, 2 * bits, 3 * bits, 0, bits, 2 * bits, 3 * bits};
    uint64_t x = 0;
    std::memcpy(&x, src, bits);
    uint32_t lo = uint32_t(x), hi = uint32_t(x >> (4 * bits));
    v = ((u8v){lo, lo, lo, lo, hi, hi, hi, hi} >> shifts) & mask;
  }
  return __builtin_convertvector((i8v)v, f8);
}

template <typename S>
inline float to_float(S x) {
  return static_cast<float>(x);
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
  for (int g = 0; g < D / gs; ++g) {
    f8 scale = (f8){} + to_float(sc[g]);
    f8 bias = (f8){} + to_float(bi[g]);
    for (int i = g * gs; i < (g + 1) * gs; i += 8) {
      store8(out + i, unpack8<bits>(w + i * bits / 8) * scale + bias);
    }
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
    for (int m = 0; m < M; ++m) {
      const float* qm = q + size_t(m) * D;
      f8 a0 = {}, a1 = {};
      for (int i = 0; i < D; i += 16) {
        a0 += load8(qm + i) * load8(k + i);
        a1 += load8(qm + i + 8) * load8(k + i + 8);
      }
      out[size_t(m) * N + n] = hsum(a0 + a1);
    }
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
    for (int m = 0; m < M; ++m) {
      f8 pm = (f8){} + p[size_t(m) * N + n];
      float* o = acc + size_t(m) * D;
      for (int i = 0; i < D; i += 8) {
        store8(o + i, load8(o + i) + pm * load8(v + i));
      }
    }
  }
}

enum class Kind { Scores, Weighted };

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

template <typename S>
void run_bits(Kind kind, int bits, const std::vector<mx::array>& in, mx::array& out, int gs) {
  switch (bits) {
    case 2: return run<2, S>(kind, in, out, gs);
    case 3: return run<3, S>(kind, in, out, gs);
    case 4: return run<4, S>(kind, in, out, gs);
    case 5: return run<5, S>(kind, in, out, gs);
    case 6: return run<6, S>(kind, in, out, gs);
    case 8: return run<8, S>(kind, in, out, gs);
    default: throw std::invalid_argument("kvq native: unsupported bits");
  }
}

class PackedProduct : public mx::Primitive {
 public:
  PackedProduct(mx::Stream s, Kind kind, int bits, int group_size)
      : mx::Primitive(s), kind_(kind), bits_(bits), gs_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, kind = kind_, bits = bits_, gs = gs_]() mutable {
      auto dt = inputs[2].dtype();
      if (dt == mx::float16) {
        run_bits<mx::float16_t>(kind, bits, inputs, out, gs);
      } else if (dt == mx::bfloat16) {
        run_bits<mx::bfloat16_t>(kind, bits, inputs, out, gs);
      } else {
        run_bits<float>(kind, bits, inputs, out, gs);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("kvq native: CPU only");
  }

  const char* name() const override {
    return kind_ == Kind::Scores ? "KvqPackedScores" : "KvqPackedWeighted";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PackedProduct*>(&other);
    return o && o->kind_ == kind_ && o->bits_ == bits_ && o->gs_ == gs_;
  }

 private:
  Kind kind_;
  int bits_;
  int gs_;
};

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
                   std::make_shared<PackedProduct>(s, Kind::Scores, bits, group_size),
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
                   std::make_shared<PackedProduct>(s, Kind::Weighted, bits, group_size),
                   {mx::astype(p, mx::float32, s), w, scales, biases});
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
  m.def("packed_weighted", &packed_weighted, "p"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "float32 p @ V with V packed (B, H, N, D*bits/32); (B, H, M, D)");
}
