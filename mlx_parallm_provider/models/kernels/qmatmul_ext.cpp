// qmatmul.c's kernel as an MLX primitive, so a decode step stays one lazy graph.
//
// Called through ctypes, every kernel call needs its input evaluated first (a synchronisation
// of MLX's CPU stream, ~60 us); as a primitive it is scheduled on the stream like MLX's own
// CPU ops. CPU only: eval_gpu raises. Built by models/qmatmul_ext.py with nanobind in MLX's
// nanobind domain, so mx.array arguments convert.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include "cpu_primitive.h"
#include "mlx/ops.h"

extern "C" int qmatmul(const float* x, int M, int K, const uint8_t* w, const float* scales,
                       const float* biases, int N, int bits, int group, float* y, int threads);
extern "C" int qmatmul_int8(const float* x, int M, int K, const uint8_t* w, const float* scales,
                            const float* biases, int N, int bits, int group, float* y, int threads);
extern "C" int qmatmul_x16(const float* x, int M, int K, const uint8_t* w, const float* scales,
                           const float* biases, int N, int bits, int group, float* y, int threads);
extern "C" int qm_int8_tiles(void);
extern "C" int qm_amx(int request);
extern "C" int qgemm(const float* x, int M, int K, const uint8_t* w, const float* scales, const float* biases, int N,
                     int bits, int group, float* y, void* sgemm, int tile, int threads);
extern "C" int qgemm_panels(const float* x, int M, int K, const uint8_t* w, const float* scales, const float* biases,
                            int N, int bits, int group, float* y, int threads);

namespace mx = mlx::core;
namespace nb = nanobind;

namespace mlx_parallm {  // norm_rope.cpp
mx::array rms_norm_op(const mx::array& x, const mx::array& w, float eps);
mx::array rope_op(const mx::array& x, int dims, bool traditional, float scale, const mx::array& offset,
                  const mx::array& inv_freq);
mx::array swiglu_op(const mx::array& gate, const mx::array& x);  // swiglu.cpp
mx::array gumbel_draw_op(const mx::array& rows, const mx::array& keys, int threads);  // sampling.cpp
mx::array filter_rows_op(const mx::array& logprobs, const mx::array& params, int threads);  // sampling.cpp
mx::array log_softmax_op(const mx::array& rows, int threads);  // sampling.cpp
mx::array top_tokens_op(const mx::array& rows, int k, int threads);  // sampling.cpp
mx::array lora_update_op(const mx::array& y, const mx::array& x, const mx::array& a, const mx::array& b,
                         const mx::array& slot, const mx::array& scale, int threads);  // lora_update.cpp
mx::array decode_attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                              const std::optional<mx::array>& mask, int threads);
mx::array paged_decode_attention_op(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                                    const mx::array& table, const mx::array& lengths, int block_size, float scale,
                                    int threads, int window, const std::optional<std::vector<mx::array>>& scales, int bits);
mx::array paged_attention_step_op(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& k_pool,
                                  const mx::array& v_pool, const mx::array& slots, const mx::array& table,
                                  const mx::array& limits, const mx::array& offset, const mx::array& inv_freq, int heads,
                                  int rope_dims, bool traditional, float rope_scale, int block_size, float scale, int threads,
                                  const std::optional<std::vector<mx::array>>& scales);
mx::array decoder_layer_op(const mx::array& x, const mx::array& w_in, float eps_in, const mx::array& w_post, float eps_post,
                           const std::vector<mx::array>& weights, const std::vector<int>& bits, const std::vector<int>& groups,
                           const mx::array& k_pool, const mx::array& v_pool, const mx::array& slots, const mx::array& table,
                           const mx::array& limits, const mx::array& offset, const mx::array& inv_freq, int heads,
                           int rope_dims, bool traditional, float rope_scale, int block_size, float scale,
                           int attention_threads, int matmul_threads, int packed_rows, int int8,
                           const std::optional<mx::array>& qkv_bias,
                           const std::optional<std::vector<mx::array>>& scales);  // decoder_layer.cpp
void set_sgemm(std::uintptr_t address);  // blas_matmul.cpp
bool has_sgemm();
void* sgemm_address();
mx::array blas_matmul_op(const mx::array& x, const mx::array& w);
}  // namespace mlx_parallm
using namespace nb::literals;

namespace {

constexpr int kMaxRows = 64;  // qmatmul.c's MAX_CALL_ROWS
constexpr int kPanelRows = 128;  // gemm inputs of at most this many rows go to qgemm_panels

class QMatmul : public mx::Primitive {
 public:
  // gemm: any number of rows, through qgemm_panels (up to kPanelRows) or qgemm (tiles of W
  // dequantized for the BLAS set by set_sgemm);
  // int8: any number of rows, x quantized in blocks of 32 to int8 (1 or 8: qmatmul_int8) or to
  // 16 bits (16: qmatmul_x16, two int8 planes); else (0) qmatmul's kernel.
  QMatmul(mx::Stream stream, int bits, int group, int threads, bool gemm = false, int int8 = 0)
      : mx::Primitive(stream), bits_(bits), group_(group), threads_(threads), gemm_(gemm), int8_(int8) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = mlx_parallm::cpu_encoder(stream(), inputs, out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), w = mx::array::unsafe_weak_copy(inputs[1]),
                      s = mx::array::unsafe_weak_copy(inputs[2]), b = mx::array::unsafe_weak_copy(inputs[3]),
                      out = mx::array::unsafe_weak_copy(out), bits = bits_, group = group_, threads = threads_,
                      gemm = gemm_, int8 = int8_]() mutable {
      using mlx_parallm::row_major;
      std::vector<char> xc, wc, sc, bc;
      int k = x.shape(-1), n = w.shape(0);
      int m = static_cast<int>(x.size() / k);
      auto xp = reinterpret_cast<const float*>(row_major(x, xc));
      auto wp = reinterpret_cast<const uint8_t*>(row_major(w, wc));
      auto sp = reinterpret_cast<const float*>(row_major(s, sc));
      auto bp = reinterpret_cast<const float*>(row_major(b, bc));
      // Up to kPanelRows rows (decode steps): qmatmul.c's panels, dequantized in cache and used
      // there; more (prefill): tiles of up to 8 MB of float32 weights for the BLAS, whose GEMM
      // is faster at many rows and pays the dequantizing once for them all.
      int tile = std::max((1 << 21) / std::max(k, 1), 16);
      int status = int8 == 16              ? qmatmul_x16(xp, m, k, wp, sp, bp, n, bits, group, out.data<float>(), threads)
                   : int8                    ? qmatmul_int8(xp, m, k, wp, sp, bp, n, bits, group, out.data<float>(), threads)
                   : gemm && m <= kPanelRows ? qgemm_panels(xp, m, k, wp, sp, bp, n, bits, group, out.data<float>(), threads)
                   : gemm ? qgemm(xp, m, k, wp, sp, bp, n, bits, group, out.data<float>(), mlx_parallm::sgemm_address(), tile, threads)
                          : qmatmul(xp, m, k, wp, sp, bp, n, bits, group, out.data<float>(), threads);
      if (status != 0) throw std::runtime_error("qmatmul: kernel failed (out of memory?)");
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("QMatmul has no GPU implementation (CPU only)");
  }

  const char* name() const override { return "QMatmul"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMatmul&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && threads_ == o.threads_ && gemm_ == o.gemm_ && int8_ == o.int8_;
  }

 private:
  int bits_, group_, threads_;
  bool gemm_;
  int int8_;
};

// x (..., K) @ W.T with W (N, K) affine-quantized: w (N, K * bits / 8) bytes (any integer
// dtype holding MLX's packing), scales and biases (N, K / group) float32. Returns (..., N)
// float32.
mx::array qmatmul_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int bits, int group, int threads, bool gemm, int int8) {
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2) {
    throw std::invalid_argument("qmatmul: x must be (..., K), w, scales and biases 2-D");
  }
  int k = x.shape(-1), n = w.shape(0);
  size_t rows = k ? x.size() / k : 0;
  bool format_ok = (bits == 4 || bits == 8) && group > 0 && group % 32 == 0 && k % group == 0;
  if (gemm && rows > static_cast<size_t>(kPanelRows) && !mlx_parallm::has_sgemm())
    throw std::runtime_error("qmatmul: gemm=True with more than 128 rows needs set_sgemm first");
  if (int8 != 0 && int8 != 1 && int8 != 8 && int8 != 16) throw std::invalid_argument("qmatmul: int8 is 0, 1 or 8 (int8 x) or 16 (16-bit x)");
  if (!format_ok || rows < 1 || (!gemm && !int8 && rows > kMaxRows) || !mx::issubdtype(w.dtype(), mx::integer) ||
      static_cast<size_t>(w.shape(1)) * w.itemsize() * 8 != static_cast<size_t>(k) * bits ||
      scales.shape() != mx::Shape{n, k / group} || biases.shape() != scales.shape()) {
    throw std::invalid_argument("qmatmul: unsupported shape or format (rows=" + std::to_string(rows) + ", K=" +
                                std::to_string(k) + ", bits=" + std::to_string(bits) +
                                ", group_size=" + std::to_string(group) + ")");
  }
  auto stream = mlx_parallm::cpu_stream();
  auto shape = x.shape();
  shape.back() = n;
  return mx::array(shape, mx::float32, std::make_shared<QMatmul>(stream, bits, group, std::max(threads, 1), gemm, int8),
                   {mx::astype(x, mx::float32, stream), w, mx::astype(scales, mx::float32, stream),
                    mx::astype(biases, mx::float32, stream)});
}

}  // namespace

NB_MODULE(mlx_parallm_qmatmul_ext, m) {
  m.doc() = "qmatmul.c's kernel, RMSNorm, RoPE, SwiGLU, Gumbel-max draws and decode attention as MLX primitives (CPU)";
  m.def("qmatmul", &qmatmul_op, "x"_a, "w"_a, "scales"_a, "biases"_a, "bits"_a, "group_size"_a, "threads"_a = 1,
        "gemm"_a = false, "int8"_a = 0,
        "x (..., K) @ W.T for W affine-quantized as MLX packs it, float32 out: at most 64 rows of x through "
        "qmatmul.c's kernel, (gemm=True) any number: up to 128 through panels of W dequantized in cache (qmatmul_gemm.h), more through tiles of W dequantized for set_sgemm's BLAS, or "
        "(int8=True or 8) any number with x quantized to int8 in blocks of 32 (integer dot products, no float weights), "
        "(int8=16) the same with x quantized to 16 bits (two int8 planes; CPUs with AVX-512 VNNI).");
  m.def("rms_norm", &mlx_parallm::rms_norm_op, "x"_a, "weight"_a, "eps"_a,
        "mx.fast.rms_norm(x, weight, eps) for float32 x, as one CPU op.");
  m.def("rope", &mlx_parallm::rope_op, "x"_a, "dims"_a, "traditional"_a, "scale"_a, "offset"_a, "inv_freq"_a,
        "mx.fast.rope for float32 x (B, ..., T, D) as one CPU op; offset an int32 array of 1 or B elements, "
        "inv_freq (dims / 2,) float32 as the fallback computes it.");
  m.def("swiglu", &mlx_parallm::swiglu_op, "gate"_a, "x"_a,
        "silu(gate) * x for float32 gate and x of one shape, as one CPU op (exp from a polynomial, rel. error < 3e-7).");
  m.def("gumbel_draw", &mlx_parallm::gumbel_draw_op, "rows"_a, "keys"_a, "threads"_a = 1,
        "Each row's argmax(rows[i] + mx.random.gumbel((V,), key=keys[i])) for float32 rows (n, V) and uint32 keys (n, 2), "
        "as one CPU op: MLX's noise bit for bit up to its logs' last bits. uint32 out, (n,).");
  m.def("filter_rows", &mlx_parallm::filter_rows_op, "logprobs"_a, "params"_a, "threads"_a = 1,
        "mlx-lm's apply_top_p, apply_min_p and apply_top_k, in that order, over each row of float32 logprobs (n, V), "
        "params (n, 3) float32: top_p (off outside (0, 1)), log(min_p) (-inf: off), top_k (off outside (0, V)), as one "
        "CPU op. float32 out, the filtered tokens -inf.");
  m.def("log_softmax", &mlx_parallm::log_softmax_op, "rows"_a, "threads"_a = 1,
        "rows - mx.logsumexp(rows, axis=-1, keepdims=True) for float32 rows (n, V), as one CPU op: bit for bit what "
        "MLX's CPU gives where its float SIMD width is 1 (x86, Linux ARM). float32 out.");
  m.def("top_tokens", &mlx_parallm::top_tokens_op, "rows"_a, "k"_a, "threads"_a = 1,
        "Each row's k largest values' indices for float32 rows (n, V), 1 <= k <= V, as one CPU op: (n, k) uint32, the "
        "largest first, of equal values the lower index first, NaN after every number.");
  m.def("decode_attention", &mlx_parallm::decode_attention_op, "q"_a, "k"_a, "v"_a, "scale"_a, "mask"_a = nb::none(),
        "threads"_a = 1,
        "Attention of q (B, H, 1, D) over k, v (B, KVH, S, D) under mask (None, or (1 or B, S) bool / additive), "
        "as one CPU op. float32 out.");
  m.def("int8_tiles", []() { return qm_int8_tiles() != 0; },
        "Whether the int8 path runs over weight tiles (AVX-512 VNNI, qmatmul_tiles.h), which int8=16 needs.");
  m.def("amx", [](int request) { return qm_amx(request) != 0; }, "request"_a = -1,
        "Whether the int8 path uses AMX; request 0 turns it off, 1 back on where Linux gives it (qm_amx).");
  m.def("set_sgemm", &mlx_parallm::set_sgemm, "address"_a,
        "Use the cblas_sgemm at this address (of a BLAS loaded privately) for blas_matmul.");
  m.def("has_sgemm", &mlx_parallm::has_sgemm, "Whether set_sgemm was given an address.");
  m.def("blas_matmul", &mlx_parallm::blas_matmul_op, "x"_a, "w"_a,
        "x (..., K) @ w.T for float32 x and w (N, K), through the sgemm of set_sgemm, as one CPU op.");
  m.def("paged_decode_attention", &mlx_parallm::paged_decode_attention_op, "q"_a, "k_pool"_a, "v_pool"_a, "table"_a,
        "lengths"_a, "block_size"_a, "scale"_a, "threads"_a = 1, "window"_a = 0, "scales"_a = nb::none(), "bits"_a = 0,
        "Attention of q (B, H, L, D) over each row's first lengths[b] (L = 1) or lengths[b][j] slots of its blocks table[b] in the pools "
        "(N, KVH, D), block_size slots a block, as one CPU op; window > 0: the last window of them only. Pools float32 or float16, "
        "or quantized: uint32 codes (N, KVH, D * bits / 32) of mx.quantize with group size 32, scales [K scales, K biases, V scales, "
        "V biases] float16 (N, KVH, D / 32), bits 8 or 4; float32 out.");
  m.def("paged_attention_step", &mlx_parallm::paged_attention_step_op, "q"_a, "k"_a, "v"_a, "k_pool"_a, "v_pool"_a,
        "slots"_a, "table"_a, "limits"_a, "offset"_a, "inv_freq"_a, "heads"_a, "rope_dims"_a, "traditional"_a,
        "rope_scale"_a, "block_size"_a, "scale"_a, "threads"_a = 1, "scales"_a = nb::none(),
        "A decode or verify step's attention as one CPU op: RoPE of q (B, L, heads * D) and k (B, L, KVH * D) at "
        "positions offset[b] + j, k and v written IN PLACE into the pools (N, KVH, D) at slots (B * L,) (order later "
        "readers of the pools after the result, e.g. with mx.depends), then paged_decode_attention over table and "
        "limits. float32 out, (B, L, heads * D). Quantized pools: uint32 codes, scales as paged_decode_attention's (the new K/V "
        "quantized as mx.quantize does, bit for bit).");
  m.def("decoder_layer", &mlx_parallm::decoder_layer_op, "x"_a, "w_in"_a, "eps_in"_a, "w_post"_a, "eps_post"_a, "weights"_a,
        "bits"_a, "groups"_a, "k_pool"_a, "v_pool"_a, "slots"_a, "table"_a, "limits"_a, "offset"_a, "inv_freq"_a, "heads"_a,
        "rope_dims"_a, "traditional"_a, "rope_scale"_a, "block_size"_a, "scale"_a, "attention_threads"_a = 1,
        "matmul_threads"_a = 1, "packed_rows"_a = 64, "int8"_a = 0, "qkv_bias"_a = nb::none(), "scales"_a = nb::none(),
        "A llama (or qwen2: qkv_bias, the q, k and v biases concatenated) decoder layer's step of at most 128 rows as one CPU op: RMSNorm, the packed q/k/v, o, gate/up and down "
        "matmuls (qmatmul.c's kernel up to packed_rows rows, its panels above, or int8), the fused attention step (K/V written IN PLACE into the pools: order later readers after the result) "
        "and SwiGLU, each as its own op computes it. float32 out, x's shape.");
  m.def("lora_update", &mlx_parallm::lora_update_op, "y"_a, "x"_a, "a"_a, "b"_a, "slot"_a, "scale"_a, "threads"_a = 1,
        "y + scale[b] * ((x @ a[slot[b]].T) @ b[slot[b]]) for float32 y (B, L, N), x (B, L, K), a (S, R, K), b (S, R, N), "
        "slot (B,) uint32 and scale (B,), as one CPU op (rows of slot 0: y). float32 out, y's shape.");
  m.attr("paged_float16_pools") = nb::bool_(true);  // what attention.py asks before handing it float16 pools
  m.attr("paged_positions") = nb::bool_(true);      // ... several query positions a row, lengths (B, L)
  m.attr("paged_windows") = nb::bool_(true);        // ... a sliding window (window > 0)
  m.attr("paged_quantized_pools") = nb::bool_(true);  // ... quantized pools (uint32 codes, scales and bits)
  m.attr("step_quantized_pools") = nb::bool_(true);   // ... and its fused steps (paged_attention_step, decoder_layer) too
}
