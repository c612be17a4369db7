// A llama decoder layer's decode (or verify) step of up to 128 rows as one MLX op (CPU).
//
// On the CPU every MLX op costs ~15 us beside its work (its task is handed to the stream's
// thread, which sleeps between small ops): a one-row step of the default model is ~320 such
// ops, a third of its time. This op runs the layer's parts in order on the caller's arrays,
// each through the very function its own op calls, so the result is the same bit for bit:
//   h = x + o_proj(attention_step(qkv_proj(rms_norm(x, w_in))))
//   out = h + down_proj(swiglu(gate_up_proj(rms_norm(h, w_post))))
// qkv_proj and gate_up_proj are the concatenated packed weights of the sibling layers
// (small_batch.SharedInput), multiplied as QMatmul multiplies them (qmatmul.c's kernel up to
// packed_rows rows, its panels above, or its int8 path at every row count); the
// attention step writes the new K/V into the pools in place (decode_attention.cpp).
//
// Inputs: x (B, L, Dm) float32; w_in, w_post (Dm,) float32; four packed weights as
// (bytes, scales, biases): qkv (heads * D + 2 * KVH * D rows), o (Dm rows), gate_up (2 * I
// rows: gate, then up), down (Dm rows); k_pool, v_pool (N, KVH, D); slots (B * L,); table
// (B, M); limits (B,) or (B, L); offset (B,); inv_freq (rope_dims / 2,); then, for a qwen2 layer,
// the q, k and v biases concatenated (heads * D + 2 * KVH * D,), added to qkv_proj's output as
// each projection's own op adds its bias. Quantized pools (uint32 codes): their K scales and
// biases, V scales and biases follow inv_freq (in[22 .. 25]), before any q/k/v biases. Output (B, L, Dm).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_step.h"
#include "cpu_primitive.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

extern "C" int qmatmul(const float* x, int M, int K, const uint8_t* w, const float* scales, const float* biases, int N,
                       int bits, int group, float* y, int threads);
extern "C" int qmatmul_int8(const float* x, int M, int K, const uint8_t* w, const float* scales, const float* biases,
                            int N, int bits, int group, float* y, int threads);
extern "C" int qmatmul_x16(const float* x, int M, int K, const uint8_t* w, const float* scales,
                           const float* biases, int N, int bits, int group, float* y, int threads);
extern "C" int qgemm_panels(const float* x, int M, int K, const uint8_t* w, const float* scales, const float* biases,
                            int N, int bits, int group, float* y, int threads);

namespace mlx_parallm {

void rms_norm_row(const float* src, int64_t xs, const float* w, int64_t ws, int d, float eps, float* dst);  // norm_rope.cpp
void swiglu_rows(const float* g, const float* x, float* out, size_t n);                                   // swiglu.cpp

namespace {

struct LayerParams {
  StepParams step;  // the attention step's (its threads: the attention's)
  float eps_in, eps_post;
  int matmul_threads, packed_rows;
  int int8;       // 0 float, 1 or 8 int8 x, 16 16-bit x (as QMatmul)
  bool qkv_bias;  // the last input holds q/k/v's biases
  std::vector<int> bits, groups;  // of qkv, o, gate_up, down
  bool operator==(const LayerParams& o) const {
    return step == o.step && eps_in == o.eps_in && eps_post == o.eps_post && matmul_threads == o.matmul_threads &&
           packed_rows == o.packed_rows && int8 == o.int8 && qkv_bias == o.qkv_bias && bits == o.bits && groups == o.groups;
  }
};

class DecoderLayerCPU : public CpuPrimitive<DecoderLayerCPU> {
 public:
  DecoderLayerCPU(mx::Stream stream, LayerParams p) : CpuPrimitive(stream), params(std::move(p)) {}

  const char* name() const override { return "DecoderLayerCPU"; }

  LayerParams params;

  static void run(const std::vector<mx::array>& in, mx::array& out, const LayerParams& prm) {
    std::vector<char> xc;
    const float* x_in = reinterpret_cast<const float*>(row_major(in[0], xc));
    int B = in[0].shape(0), L = in[0].shape(1), dm = in[0].shape(2);
    // (the K pool's (N, KVH, D); quantized: its codes', D from its scales' (N, KVH, D / 32), in[22])
    int KVH = in[15].shape(1), D = in[15].dtype() == mx::uint32 ? in[22].shape(2) * 32 : in[15].shape(2), hd = prm.step.heads * D;
    int n_qkv = in[3].shape(0), inter = in[9].shape(0) / 2;
    // A right-padded pass (verify steps, short prefill pieces) computes its real positions
    // only: padding repeats its row's last limit (see decode_attention.cpp's paged_attend).
    // Its rows are gathered into `x` (rows: their number), and each padding position's
    // output is its row's last real position's. A row's sums do not depend on the rows
    // beside it, so the real positions' outputs are what the padded pass computed.
    std::vector<int> real;  // of each computed row, its index b * L + j in the pass
    std::vector<int> first(B + 1, 0);  // row b's real positions are computed rows first[b] .. first[b + 1) - 1
    for (int b = 0; b < B; b++) {
      int n = L > 1 ? real_positions(in[19].data<int32_t>() + static_cast<int64_t>(b) * L, L) : 1;
      for (int j = 0; j < n; j++) real.push_back(b * L + j);
      first[b + 1] = first[b] + n;
    }
    bool padded = static_cast<int>(real.size()) < B * L;
    int rows = static_cast<int>(real.size());
    // The computed row that position j of row b reads: its own, or (padding) its row's last real one.
    auto computed = [&](int b, int j) { return std::min(first[b] + j, first[b + 1] - 1); };
    std::vector<float> gathered;
    const float* x = x_in;
    if (padded) {
      gathered.resize(static_cast<size_t>(rows) * dm);
      for (int r = 0; r < rows; r++) std::memcpy(gathered.data() + static_cast<size_t>(r) * dm, x_in + static_cast<size_t>(real[r]) * dm, dm * sizeof(float));
      x = gathered.data();
    }
    // The weights' (bytes, scales, biases) at in[3 + 3 * i], each multiplied as QMatmul does.
    // The kernel is the one QMatmul picks for the whole pass, padding included (B * L rows), not
    // for the real rows alone: the few-row kernel and the panels add a row's products in
    // different orders (on AVX2), and the layer's outputs are its separate ops', bit for bit.
    auto matmul = [&](int i, const float* a, int k, float* y) {
      const auto &w = in[3 + 3 * i], &s = in[4 + 3 * i], &b = in[5 + 3 * i];
      auto kernel = prm.int8 == 16 ? qmatmul_x16 : prm.int8 ? qmatmul_int8 : B * L <= prm.packed_rows ? qmatmul : qgemm_panels;
      if (kernel(a, rows, k, w.data<uint8_t>(), s.data<float>(), b.data<float>(), w.shape(0), prm.bits[i], prm.groups[i], y,
                 prm.matmul_threads) != 0)
        throw std::runtime_error("decoder_layer: kernel failed (out of memory?)");
    };
    const float* w_in = in[1].data<float>();
    const float* w_post = in[2].data<float>();
    std::vector<float> normed(static_cast<size_t>(rows) * dm), qkv(static_cast<size_t>(rows) * n_qkv),
        attended(static_cast<size_t>(B) * L * hd), h(static_cast<size_t>(rows) * dm), gate_up(static_cast<size_t>(rows) * 2 * inter),
        gated(static_cast<size_t>(rows) * inter), compact_out(padded ? static_cast<size_t>(rows) * dm : 0);
    float* o = padded ? compact_out.data() : out.data<float>();  // o_proj's, then down_proj's output before the residual
    for (int r = 0; r < rows; r++) rms_norm_row(x + static_cast<size_t>(r) * dm, 1, w_in, 1, dm, prm.eps_in, normed.data() + static_cast<size_t>(r) * dm);
    matmul(0, normed.data(), dm, qkv.data());
    if (prm.qkv_bias) {
      const float* bias = in.back().data<float>();
      for (int r = 0; r < rows; r++)
        for (int j = 0; j < n_qkv; j++) qkv[static_cast<size_t>(r) * n_qkv + j] += bias[j];
    }
    // The attention step takes every position of the pass: a padding position reads its
    // row's last real one's q/k/v (its K/V go to the null block; it is not attended).
    int all = B * L;
    std::vector<const float*> parts(3 * static_cast<size_t>(all));
    for (int b = 0; b < B; b++)
      for (int j = 0; j < L; j++) {
        int r = b * L + j;
        const float* row = qkv.data() + static_cast<size_t>(computed(b, j)) * n_qkv;
        parts[r] = row, parts[all + r] = row + hd, parts[2 * all + r] = row + hd + KVH * D;
      }
    attention_step_rows(parts.data(), parts.data() + all, parts.data() + 2 * all, &in[15], B, L, prm.step, attended.data());
    if (padded)
      for (int r = 0; r < rows; r++)
        std::memmove(attended.data() + static_cast<size_t>(r) * hd, attended.data() + static_cast<size_t>(real[r]) * hd, hd * sizeof(float));
    matmul(1, attended.data(), hd, o);
    for (size_t i = 0; i < h.size(); i++) h[i] = x[i] + o[i];
    for (int r = 0; r < rows; r++) rms_norm_row(h.data() + static_cast<size_t>(r) * dm, 1, w_post, 1, dm, prm.eps_post, normed.data() + static_cast<size_t>(r) * dm);
    matmul(2, normed.data(), dm, gate_up.data());
    for (int r = 0; r < rows; r++) {
      const float* row = gate_up.data() + static_cast<size_t>(r) * 2 * inter;
      swiglu_rows(row, row + inter, gated.data() + static_cast<size_t>(r) * inter, inter);
    }
    matmul(3, gated.data(), inter, o);
    for (size_t i = 0; i < h.size(); i++) o[i] = h[i] + o[i];
    if (padded)  // scattered back; padding takes its row's last real position's output
      for (int b = 0; b < B; b++)
        for (int j = 0; j < L; j++)
          std::memcpy(out.data<float>() + static_cast<size_t>(b * L + j) * dm, o + static_cast<size_t>(computed(b, j)) * dm, dm * sizeof(float));
  }
};

}  // namespace

// See the file comment. weights: the 12 arrays of qkv, o, gate_up and down (bytes, scales,
// biases each); bits and groups: theirs.
mx::array decoder_layer_op(const mx::array& x, const mx::array& w_in, float eps_in, const mx::array& w_post, float eps_post,
                           const std::vector<mx::array>& weights, const std::vector<int>& bits, const std::vector<int>& groups,
                           const mx::array& k_pool, const mx::array& v_pool, const mx::array& slots, const mx::array& table,
                           const mx::array& limits, const mx::array& offset, const mx::array& inv_freq, int heads,
                           int rope_dims, bool traditional, float rope_scale, int block_size, float scale,
                           int attention_threads, int matmul_threads, int packed_rows, int int8,
                           const std::optional<mx::array>& qkv_bias, const std::optional<std::vector<mx::array>>& scales) {
  if (x.ndim() != 3 || weights.size() != 12 || bits.size() != 4 || groups.size() != 4 || k_pool.ndim() != 3 || heads < 1) {
    throw std::invalid_argument("decoder_layer: x (B, L, Dm), 12 weight arrays with 4 bits and groups, pools (N, KVH, D)");
  }
  auto stream = cpu_stream();
  StepParams step{scale, rope_scale, block_size, std::max(attention_threads, 1), heads, rope_dims, traditional};
  int B = x.shape(0), L = x.shape(1), dm = x.shape(2), KVH = k_pool.shape(1);
  std::vector<mx::array> attention =
      step_inputs("decoder_layer", B, L, step, k_pool, v_pool, slots, table, limits, offset, inv_freq, stream, scales);
  int D = attention.size() > 7 ? attention[7].shape(2) * 32 : k_pool.shape(2);  // (quantized pools: from their scales)
  int n_qkv = heads * D + 2 * KVH * D;
  // Each weight's (rows, input width): qkv, o, gate_up, down.
  int inter = weights[6].shape(0) / 2;
  int rows_of[4] = {n_qkv, dm, 2 * inter, dm}, widths[4] = {dm, heads * D, dm, inter};
  for (int i = 0; i < 4; i++) {
    const auto &w = weights[3 * i], &s = weights[3 * i + 1], &b = weights[3 * i + 2];
    if ((bits[i] != 4 && bits[i] != 8) || groups[i] <= 0 || groups[i] % 32 || widths[i] % groups[i] || w.dtype() != mx::uint8 ||
        w.shape() != mx::Shape{rows_of[i], widths[i] * bits[i] / 8} || s.dtype() != mx::float32 || b.dtype() != mx::float32 ||
        s.shape() != mx::Shape{rows_of[i], widths[i] / groups[i]} || b.shape() != s.shape()) {
      throw std::invalid_argument("decoder_layer: weight " + std::to_string(i) + " is not a packed (bytes, scales, biases) of " +
                                  std::to_string(rows_of[i]) + " x " + std::to_string(widths[i]));
    }
  }
  if (w_in.size() != static_cast<size_t>(dm) || w_post.size() != static_cast<size_t>(dm) || B * L > 128 || packed_rows > 64) {
    throw std::invalid_argument("decoder_layer: norm weights (Dm,), at most 128 rows, packed_rows at most 64");
  }
  if (qkv_bias && (qkv_bias->ndim() != 1 || qkv_bias->size() != static_cast<size_t>(n_qkv))) {
    throw std::invalid_argument("decoder_layer: qkv_bias (" + std::to_string(n_qkv) + ",)");
  }
  auto f32 = [&](const mx::array& a) { return mx::astype(a, mx::float32, stream); };
  std::vector<mx::array> inputs = {f32(x), f32(w_in), f32(w_post)};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  inputs.insert(inputs.end(), attention.begin(), attention.end());
  if (qkv_bias) inputs.push_back(f32(*qkv_bias));  // (its data read as is: the caller's concatenation, contiguous)
  LayerParams p{step, eps_in, eps_post, std::max(matmul_threads, 1), packed_rows, int8, qkv_bias.has_value(), bits, groups};
  return mx::array(x.shape(), mx::float32, std::make_shared<DecoderLayerCPU>(stream, std::move(p)), std::move(inputs));
}

}  // namespace mlx_parallm
