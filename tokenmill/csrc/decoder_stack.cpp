// A decoder stack's layers run by one native call per step (model/native_stack.py builds it).
//
// At batch 1 a layer's weights take tens of µs to stream, while the Python around its dozen kernels
// (module calls, views, dtype checks, a dispatch per op) costs as much again: at 30 layers that was a
// third of a decode step. This runs the same kernels in the same order as the Python layers
// (model/blocks.py: DecoderLayer, AttentionBlock, MLPBlock with fused.py's ops and the cpu_paged
// backend), called through the dispatcher, so the output is bit for bit the Python path's; only the
// Python between them is gone.
//
// Covered: pre-norm layers (RMSNorm, optional q/k norms), rotate-half rotary, paged attention on a float32
// or bfloat16 cache, a gated MLP (silu or gelu_tanh), linear layers dense float32, GGUF blocks, int8 or
// int4 rows, at tensor-parallel size 1. Anything else keeps the Python layers (native_stack.py decides).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <tuple>
#include <vector>

namespace tokenmill {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// ---- the component kernels, by their registered schemas (csrc/*.cpp) -----------------------------
c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  static auto h = op("tokenmill::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, double)>();
  return h.call(x, w, eps, offset);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps, double offset) {
  static auto h = op("tokenmill::add_rms_norm")
                      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                double, double)>();
  return h.call(x, r, w, eps, offset);
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& pos,
                                          const at::Tensor& cos, const at::Tensor& sin) {
  static auto h = op("tokenmill::rotary")
                      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                const at::Tensor&, const at::Tensor&)>();
  return h.call(q, k, pos, cos, sin);
}

at::Tensor act_and_mul(const at::Tensor& gate_up, int64_t act) {
  static auto silu = op("tokenmill::silu_and_mul").typed<at::Tensor(const at::Tensor&)>();
  static auto gelu = op("tokenmill::gelu_tanh_and_mul").typed<at::Tensor(const at::Tensor&)>();
  return act == 0 ? silu.call(gate_up) : gelu.call(gate_up);
}

// The typed signature must be the kernel's own, by-value out and caches included.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots, const at::Tensor& table,
                     const at::Tensor& qs, const at::Tensor& ql, const at::Tensor& kvl, double scale, int64_t window,
                     double cap) {
  static auto h = op("tokenmill::paged_attention")
                      .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                  at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, double, int64_t, double)>();
  h.call(out, q, k, v, kc, vc, slots, table, qs, ql, kvl, scale, window, cap);
}

// ---- linear layers --------------------------------------------------------------------------------
enum class Kind : int64_t { Dense = 0, GGUF = 1, Int8 = 2, Int4 = 3, Int8PerToken = 4 };

struct Linear {
  Kind kind;
  at::Tensor w;  // dense float32 [N, K]; GGUF block rows; int8 rows; int4 packed nibbles
  OptTensor bias;
  at::Tensor scale, zero;  // int8: scale [N]; int4: scale, zero [N, K/group]
  int64_t qtype = 0, K = 0, group = 0;
  bool x8 = false;  // int8 activations (the kernels' batch-1 switch)
  bool bf16 = false;  // GGUF: batches as bf16 GEMMs (--quantized-batch-dtype bfloat16)

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case Kind::Dense: {  // csrc/dense_linear.cpp: its own kernel for few rows, else at::linear
        static auto h = op("tokenmill::dense_linear")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
        return h.call(x, w, bias);
      }
      case Kind::GGUF: {
        static auto h = op("tokenmill::gguf_linear")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const OptTensor&,
                                              bool, bool)>();
        return h.call(x, w, qtype, K, bias, x8, bf16);
      }
      case Kind::Int8: {
        static auto h = op("tokenmill::int8_linear")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                              bool)>();
        return h.call(x, w, scale, bias, x8);
      }
      case Kind::Int8PerToken: {
        static auto h = op("tokenmill::int8_linear_per_token")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)>();
        return h.call(x, w, scale, bias);
      }
      case Kind::Int4: {
        static auto h = op("tokenmill::int4_linear")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, int64_t, const OptTensor&, bool)>();
        return h.call(x, w, scale, zero, group, bias, x8);
      }
    }
    TORCH_CHECK(false, "decoder_stack: unknown linear kind");
  }
};

Kind kind_of(const std::string& name) {
  if (name == "dense") return Kind::Dense;
  if (name == "gguf") return Kind::GGUF;
  if (name == "int8") return Kind::Int8;
  if (name == "int4") return Kind::Int4;
  if (name == "int8_per_token") return Kind::Int8PerToken;
  TORCH_CHECK(false, "decoder_stack: unknown linear kind '", name, "' (dense, gguf, int8, int4, int8_per_token)");
}

at::Tensor or_empty(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }

// ---- one layer ------------------------------------------------------------------------------------
struct Layer {
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // q_norm / k_norm undefined: no q/k norms
  double eps = 1e-6, offset = 0.0;
  int64_t qkv = -1, o = -1, gate_up = -1, down = -1;  // indices into DecoderStack::linears
  int64_t H = 0, Hk = 0, D = 0;
  double scale = 1.0, cap = 0.0;
  int64_t window = 0, act = 0;  // act: 0 silu, 1 gelu_tanh
  at::Tensor cos, sin;
  at::Tensor k_cache, v_cache;
};

}  // namespace

struct DecoderStack : torch::CustomClassHolder {
  std::vector<Linear> linears;
  std::vector<Layer> layers;

  int64_t add_linear(const std::string& kind, const at::Tensor& w, const OptTensor& bias, const OptTensor& scale,
                     const OptTensor& zero, int64_t qtype, int64_t K, int64_t group, bool x8, bool bf16) {
    Linear l{kind_of(kind), w, bias, or_empty(scale), or_empty(zero), qtype, K, group, x8, bf16};
    TORCH_CHECK(w.device().is_cpu(), "decoder_stack: CPU weights only");
    if (l.kind == Kind::Dense) TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "decoder_stack: dense "
                                           "weights must be float32 [N, K]");
    if (l.kind == Kind::Int8 || l.kind == Kind::Int8PerToken)
      TORCH_CHECK(l.scale.defined(), "decoder_stack: int8 needs its scales");
    if (l.kind == Kind::Int4) TORCH_CHECK(l.scale.defined() && l.zero.defined() && group > 0,
                                          "decoder_stack: int4 needs scales, zeros and a group size");
    linears.push_back(std::move(l));
    return (int64_t)linears.size() - 1;
  }

  int64_t add_layer(const at::Tensor& in_norm, const at::Tensor& post_norm, double eps, double offset,
                    const OptTensor& q_norm, const OptTensor& k_norm, int64_t qkv, int64_t o, int64_t gate_up,
                    int64_t down, int64_t H, int64_t Hk, int64_t D, double scale, int64_t window, double cap,
                    const at::Tensor& cos, const at::Tensor& sin, int64_t act) {
    const int64_t n = (int64_t)linears.size();
    for (int64_t i : {qkv, o, gate_up, down}) TORCH_CHECK(0 <= i && i < n, "decoder_stack: no linear ", i);
    TORCH_CHECK(act == 0 || act == 1, "decoder_stack: act is 0 (silu) or 1 (gelu_tanh)");
    Layer L;
    L.in_norm = in_norm;
    L.post_norm = post_norm;
    L.q_norm = or_empty(q_norm);
    L.k_norm = or_empty(k_norm);
    L.eps = eps;
    L.offset = offset;
    L.qkv = qkv, L.o = o, L.gate_up = gate_up, L.down = down;
    L.H = H, L.Hk = Hk, L.D = D;
    L.scale = scale, L.window = window, L.cap = cap, L.act = act;
    L.cos = cos, L.sin = sin;
    layers.push_back(std::move(L));
    return (int64_t)layers.size() - 1;
  }

  // The caches are set (and re-set) apart from the layers: the backend allocates them after the model.
  void set_kv_cache(int64_t i, const at::Tensor& k, const at::Tensor& v) {
    TORCH_CHECK(0 <= i && i < (int64_t)layers.size(), "decoder_stack: no layer ", i);
    TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                    (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
                "decoder_stack: float32 or bfloat16 KV caches only");
    layers[i].k_cache = k;
    layers[i].v_cache = v;
  }

  // x [T, hidden] float32 and the residual stream (None before the first layer: x is the embeddings).
  // Returns (last layer's output, residual, seconds spent in attention when timed, else 0).
  std::tuple<at::Tensor, at::Tensor, double> forward(at::Tensor x, const OptTensor& residual_in,
                                                     const at::Tensor& positions, const at::Tensor& slots,
                                                     const at::Tensor& table, const at::Tensor& query_start,
                                                     const at::Tensor& query_len, const at::Tensor& kv_len,
                                                     bool time_attention) {
    using clock = std::chrono::steady_clock;
    double attn_s = 0.0;
    at::Tensor residual = or_empty(residual_in);
    const int64_t T = x.size(0);
    for (const Layer& L : layers) {
      TORCH_CHECK(L.k_cache.defined(), "decoder_stack: a layer has no KV cache yet");
      if (!residual.defined()) {
        residual = x;
        x = rms_norm(x, L.in_norm, L.eps, L.offset);
      } else {
        std::tie(residual, x) = add_rms_norm(residual, x, L.in_norm, L.eps, L.offset);
      }
      // attention: qkv in one GEMM, views of its columns
      const at::Tensor qkv = linears[L.qkv](x);
      const int64_t qw = L.H * L.D, kw = L.Hk * L.D;
      at::Tensor q = qkv.narrow(1, 0, qw).view({T, L.H, L.D});
      at::Tensor k = qkv.narrow(1, qw, kw).view({T, L.Hk, L.D});
      const at::Tensor v = qkv.narrow(1, qw + kw, kw).view({T, L.Hk, L.D});
      if (L.q_norm.defined()) {
        q = norm_heads(q, L.q_norm, L);
        k = norm_heads(k, L.k_norm, L);
      }
      std::tie(q, k) = rotary(q, k, positions, L.cos, L.sin);
      const auto t0 = time_attention ? clock::now() : clock::time_point{};
      const at::Tensor qf = q.to(at::kFloat).contiguous();
      const at::Tensor out = at::empty_like(qf);
      const auto cd = L.k_cache.scalar_type();
      paged_attention(out, qf, k.to(cd).contiguous(), v.to(cd).contiguous(), L.k_cache, L.v_cache, slots, table,
                      query_start, query_len, kv_len, L.scale, L.window, L.cap);
      if (time_attention) attn_s += std::chrono::duration<double>(clock::now() - t0).count();
      const at::Tensor h = linears[L.o](out.reshape({T, -1}));
      std::tie(residual, x) = add_rms_norm(residual, h, L.post_norm, L.eps, L.offset);
      // gated MLP
      x = linears[L.down](act_and_mul(linears[L.gate_up](x), L.act));
    }
    return {x, residual, attn_s};
  }

  int64_t num_layers() const { return (int64_t)layers.size(); }

 private:
  // fused.rms_norm over the last dim of a [T, heads, D] view, as the Python RMSNorm module does it.
  static at::Tensor norm_heads(const at::Tensor& t, const at::Tensor& w, const Layer& L) {
    at::Tensor t2 = t.reshape({-1, t.size(-1)});
    if (t2.stride(-1) != 1) t2 = t2.contiguous();
    return rms_norm(t2, w, L.eps, L.offset).view(t.sizes());
  }
};

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<tokenmill::DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add_linear", &tokenmill::DecoderStack::add_linear)
      .def("add_layer", &tokenmill::DecoderStack::add_layer)
      .def("set_kv_cache", &tokenmill::DecoderStack::set_kv_cache)
      .def("forward", &tokenmill::DecoderStack::forward)
      .def("num_layers", &tokenmill::DecoderStack::num_layers);
}
