// The eager routes' C++ layer, written once for every backend whose kernels are C++ functions:
// the fused unit's autograd rule as C++ autograd nodes (one convolution: UnitNode; two
// convolutions of one BN-ReLU: PairNode; the unit handing x on as an identity shortcut:
// ShortcutNode), and a BNReLUConv2d module's forward in one call
// (module_unit: prepare_batch_norm, then the unit's node). The cpu backend (csrc/cpu) and both
// copies of the cuda backend (csrc/cuda/eager.cu: nvcc's and the host layer's) instantiate them
// with their kernels. Host-only code, plain C++ (nvcc compiles it as host code of eager.cu).
//
// Why C++: on the eager routes a step is bound by host time. An autograd.Function in Python
// costs a small unit ~50 us a step (its apply, the engine's call into Python, the backward's
// argument handling), and the Python checks and preparation of a module's forward ~50 us more
// (benchmarks/RESULTS.md); here forward and backward run without a Python frame.
//
// A kernel set K (a struct of static members) gives:
//   kDevice, kNamespace      the device type the kernels run on, the ops' namespace (errors)
//   on_device(t)             t is on the device the kernels run on
//   takes_dtype(dt)          module_unit takes x of dtype dt
//   prepare                  prepare_batch_norm's schema (fusedres/ops/opdefs.py NAMESPACE_SCHEMAS)
//   forward, genstats        bn_relu_conv2d's and bn_relu_conv2d_genstats's schemas
//   backward                 bn_relu_conv2d_backward's schema
//   backward_add             (ShortcutNode only) bn_relu_conv2d_backward_add's schema
//   kPairKernels             true: pair_forward / pair_backward, the schemas of
//                            bn_relu_conv2d_pair / _pair_backward, run the pair (one activation
//                            recompute for both convolutions); false: the pair is two forward
//                            and two backward calls, the shared gradients summed
// Every kernel is called below autograd (AutoDispatchBelowADInplaceOrView), directly: no
// dispatcher in between. Each kernel checks its arguments (checks.h) before it reads anything; the
// templates here check what they use first themselves (the pair composed of two calls, a
// module's forward).
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "common.h"
#include "prepare.h"

namespace fusedres::eager {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using SymInts = c10::SymIntArrayRef;
using Grads5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Grads7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// bn_relu_conv2d_backward's C++ signature (SCHEMAS in fusedres/ops/opdefs.py).
using BackwardFn = Grads5(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                          const OptTensor& bn_weight, const OptTensor& bn_bias,
                          const Tensor& mean, const Tensor& invstd, SymInts stride,
                          SymInts padding, SymInts dilation, bool batch_stats,
                          std::array<bool, 5> output_mask, const OptTensor& branch_scale);

inline std::vector<int64_t> ints(SymInts v) { return C10_AS_INTARRAYREF_SLOW(v).vec(); }

// Geometry lists one after another (stride, padding, dilation, ...): what a node saves.
inline std::vector<int64_t> flat_ints(std::initializer_list<SymInts> lists) {
  std::vector<int64_t> out;
  for (SymInts v : lists) {
    const auto i = ints(v);
    out.insert(out.end(), i.begin(), i.end());
  }
  return out;
}

inline OptTensor optional(const Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

inline bool any(const std::array<bool, 5>& m) { return m[0] || m[1] || m[2] || m[3] || m[4]; }

// Whether a node's backward may run the kernels on `grad` bare: grad mode off (not a backward
// that builds a graph: create_graph=True) and a plain tensor (not a batched gradient of
// autograd.grad(..., is_grads_batched=True) or vmap, not a tensor subclass). Otherwise the public
// op fusedres::bn_relu_conv2d_backward runs it, as fusedres.ops.direct_unit does in Python: its
// layers batch, trace, and refuse a double backward.
inline bool bare_gradient(const Tensor& grad) {
  constexpr c10::DispatchKeySet layered({c10::DispatchKey::Batched,
                                         c10::DispatchKey::FuncTorchBatched,
                                         c10::DispatchKey::Python,
                                         c10::DispatchKey::Functionalize});
  return !at::GradMode::is_enabled() && !grad.key_set().has_any(layered);
}

// The public op fusedres::bn_relu_conv2d_backward (fusedres/ops/__init__.py), through the dispatcher.
inline Grads5 public_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                              const OptTensor& bn_weight, const OptTensor& bn_bias,
                              const Tensor& mean, const Tensor& invstd, SymInts stride,
                              SymInts padding, SymInts dilation, bool batch_stats,
                              std::array<bool, 5> output_mask, const OptTensor& branch_scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fusedres::bn_relu_conv2d_backward", "")
                             .typed<BackwardFn>();
  return op.call(grad_out, x, weight, bn_weight, bn_bias, mean, invstd, stride, padding,
                 dilation, batch_stats, output_mask, branch_scale);
}

// ------------------------------------------------------------------------------------ the unit

// The unit's forward below autograd: (y, mean of y, biased var of y), the statistics empty
// unless genstats (eager_unit's schema; its backend-key kernel).
template <typename K>
std::tuple<Tensor, Tensor, Tensor> unit_forward(
    const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
    const OptTensor& bn_bias, const Tensor& mean, const Tensor& invstd, const OptTensor& residual,
    SymInts stride, SymInts padding, SymInts dilation, bool batch_stats,
    const OptTensor& branch_scale, bool genstats) {
  if (genstats) {
    return K::genstats(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                       padding, dilation, batch_stats, branch_scale);
  }
  return {K::forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                     padding, dilation, batch_stats, branch_scale),
          mean.new_empty({0}), mean.new_empty({0})};
}

// The gradients of a node that UnitNode::forward filled `ctx` for, from grad_out by `backward`
// (an op with bn_relu_conv2d_backward's schema, asked only for the gradients this backward
// needs), in the forward's argument order: x, weight, bias, bn_weight, bn_bias, then none for
// mean and invstd (functions of x when batch_stats: folded into x's gradient), the residual's
// (grad_out, not scaled), none for the geometry, batch_stats, branch_scale (a random draw) and
// genstats.
// `kernel` called below autograd. A backward enters that guard only around its kernels, after
// unpacking its saved tensors: an unpack may run code that records autograd (the forward that
// torch.utils.checkpoint's non-reentrant mode recomputes, which must save its tensors again);
// under the guard that code's ops would skip their autograd kernels and save nothing.
template <typename Kernel>
auto below_autograd(Kernel&& kernel) {
  return [k = std::decay_t<Kernel>(kernel)](auto&&... args) {
    at::AutoDispatchBelowADInplaceOrView below;
    return k(std::forward<decltype(args)>(args)...);
  };
}

template <typename Backward>
variable_list unit_gradients(AutogradContext* ctx, const Tensor& grad_out, Backward&& backward) {
  const auto saved = ctx->get_saved_variables();
  const Tensor &x = saved[0], &weight = saved[1], &mean = saved[4], &invstd = saved[5];
  const OptTensor bn_weight = optional(saved[2]), bn_bias = optional(saved[3]),
                  branch_scale = optional(saved[6]);
  variable_list out(14);
  const std::vector<int64_t> edges = ctx->saved_data["edges"].toIntVector();
  const auto need = [&](int i) { return edges[i] >= 0 && ctx->needs_input_grad(edges[i]); };
  const std::array<bool, 5> mask{need(0), need(1), need(2), need(3), need(4)};
  if (grad_out.defined() && any(mask)) {
    const std::vector<int64_t> g = ctx->saved_data["geometry"].toIntVector();
    const c10::IntArrayRef geo(g);
    auto [gx, gw, gb, gg, gbeta] =
        backward(grad_out, x, weight, bn_weight, bn_bias, mean, invstd,
                 c10::fromIntArrayRefSlow(geo.slice(0, 2)),
                 c10::fromIntArrayRefSlow(geo.slice(2, 2)),
                 c10::fromIntArrayRefSlow(geo.slice(4, 2)),
                 ctx->saved_data["batch_stats"].toBool(), mask, branch_scale);
    const Tensor* r[5] = {&gx, &gw, &gb, &gg, &gbeta};
    for (int i = 0; i < 5; ++i) {
      if (mask[i]) out[i] = *r[i];
    }
  }
  if (need(5)) out[7] = grad_out;
  return out;
}

// The fused unit's autograd rule (fusedres.ops.unit_setup_context / unit_backward) as a C++
// node. Self names the node (CppNode<Self>: EagerCpuUnit, EagerCudaUnit). Inputs:
// bn_relu_conv2d's, then genstats; outputs (y, mean of y, biased var of y), the statistics empty
// unless genstats and never differentiable. Saves x, the weight, the BatchNorm parameters and
// statistics and the branch scale: never the activation.
template <typename Self, typename K>
struct UnitNode : torch::autograd::Function<Self> {
  using Kernels = K;
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const OptTensor& bias, const OptTensor& bn_weight,
                               const OptTensor& bn_bias, const Tensor& mean,
                               const Tensor& invstd, const OptTensor& residual, SymInts stride,
                               SymInts padding, SymInts dilation, bool batch_stats,
                               const OptTensor& branch_scale, bool genstats) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, y_mean, y_var] =
        unit_forward<K>(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                        padding, dilation, batch_stats, branch_scale, genstats);
    const Tensor none;
    ctx->save_for_backward({x, weight, bn_weight.value_or(none), bn_bias.value_or(none), mean,
                            invstd, branch_scale.value_or(none)});
    ctx->saved_data["geometry"] = flat_ints({stride, padding, dilation});
    ctx->saved_data["batch_stats"] = batch_stats;
    // needs_input_grad counts the tensor inputs only (an absent optional is none): the index of
    // each input that can take a gradient among them, -1 when absent.
    int64_t edge = 2;  // x, weight
    const int64_t e_bias = present(bias) ? edge++ : -1;
    const int64_t e_g = present(bn_weight) ? edge++ : -1;
    const int64_t e_beta = present(bn_bias) ? edge++ : -1;
    edge += 2;  // mean, invstd
    const int64_t e_res = present(residual) ? edge : -1;
    ctx->saved_data["edges"] = std::vector<int64_t>{0, 1, e_bias, e_g, e_beta, e_res};
    ctx->mark_non_differentiable({y_mean, y_var});
    // The statistics never take a gradient; materialised, each would be a zero fill launched
    // every backward (the engine's, on the device: two a PreActBasicBlock step). Undefined
    // instead, as is y's where nothing took it.
    ctx->set_materialize_grads(false);
    return {y, y_mean, y_var};
  }

  // Gradients in the forward's argument order (unit_gradients); the kernels run bare only on a
  // bare gradient. An undefined y gradient (nothing took y) gives undefined gradients.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(14);
    if (bare_gradient(grad_out)) return unit_gradients(ctx, grad_out, below_autograd(K::backward));
    return unit_gradients(ctx, grad_out, public_backward);  // its layers handle the gradient
  }
};

// eager_unit's autograd-key kernel: the unit through Node (a UnitNode).
template <typename Node>
std::tuple<Tensor, Tensor, Tensor> eager_unit(
    const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
    const OptTensor& bn_bias, const Tensor& mean, const Tensor& invstd, const OptTensor& residual,
    SymInts stride, SymInts padding, SymInts dilation, bool batch_stats,
    const OptTensor& branch_scale, bool genstats) {
  static const std::string op = std::string(Node::Kernels::kNamespace) + ".eager_unit";
  checks::check_defined(op.c_str(), {{"x", &x}, {"weight", &weight}, {"mean", &mean},
                                     {"invstd", &invstd}});
  auto out = Node::apply(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                         padding, dilation, batch_stats, branch_scale, genstats);
  return {out[0], out[1], out[2]};
}

// The unit that also returns its input x, for a pre-activation unit's identity shortcut (the
// next unit's residual): eager_unit_with_shortcut, fusedres.ops.EagerCpuUnitWithShortcut's rule.
// Outputs (y, x as a view, mean of y, biased var of y); no residual, no branch scale. Autograd
// then sees x used once, and x's two gradients, the shortcut's and the convolution's, are summed
// in the data-gradient pass of K::backward_add (bn_relu_conv2d_backward_add's schema) instead
// of by autograd in a pass of its own. x is returned as the input itself: autograd's output
// wrapping makes it a view whose grad_fn is this node (in-place changes to it are refused, as
// to a view a Python autograd.Function returns).
template <typename Self, typename K>
struct ShortcutNode : torch::autograd::Function<Self> {
  using Kernels = K;
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const OptTensor& bias, const OptTensor& bn_weight,
                               const OptTensor& bn_bias, const Tensor& mean,
                               const Tensor& invstd, const OptTensor& residual, SymInts stride,
                               SymInts padding, SymInts dilation, bool batch_stats,
                               const OptTensor& branch_scale, bool genstats) {
    TORCH_CHECK_VALUE(!present(residual) && !present(branch_scale),
                      "eager_unit_with_shortcut: residual, branch_scale: must be None (the unit "
                      "returns x for the next unit's residual)");
    variable_list out = UnitNode<Self, K>::forward(ctx, x, weight, bias, bn_weight, bn_bias,
                                                   mean, invstd, residual, stride, padding,
                                                   dilation, batch_stats, branch_scale, genstats);
    // A gradient no output took stays undefined (UnitNode::forward says so): y's alone, or the
    // shortcut's alone.
    return {out[0], x, out[1], out[2]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor &grad_out = grads[0], &grad_short = grads[1];
    const bool want_x = ctx->needs_input_grad(0);
    if (!grad_out.defined()) {  // y took no gradient: x's is the shortcut's alone
      variable_list out(14);
      if (want_x) out[0] = grad_short;
      return out;
    }
    const bool short_in = grad_short.defined() && want_x;
    if (!bare_gradient(grad_out) || (grad_short.defined() && !bare_gradient(grad_short))) {
      // The public op, and the sum autograd would form.
      variable_list out = unit_gradients(ctx, grad_out, public_backward);
      if (short_in) out[0] = out[0].defined() ? out[0] + grad_short : grad_short;
      return out;
    }
    if (!short_in) return unit_gradients(ctx, grad_out, below_autograd(K::backward));
    return unit_gradients(ctx, grad_out, [&](auto&&... args) {
      at::AutoDispatchBelowADInplaceOrView below;
      return K::backward_add(std::forward<decltype(args)>(args)..., grad_short);
    });
  }
};

// eager_unit_with_shortcut's backend-key kernel (below autograd): (y, an alias of x, mean of y,
// biased var of y).
template <typename K>
std::tuple<Tensor, Tensor, Tensor, Tensor> shortcut_forward(
    const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
    const OptTensor& bn_bias, const Tensor& mean, const Tensor& invstd, const OptTensor& residual,
    SymInts stride, SymInts padding, SymInts dilation, bool batch_stats,
    const OptTensor& branch_scale, bool genstats) {
  TORCH_CHECK_VALUE(!present(residual) && !present(branch_scale),
                    "eager_unit_with_shortcut: residual, branch_scale: must be None (the unit "
                    "returns x for the next unit's residual)");
  auto [y, m, v] = unit_forward<K>(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual,
                                   stride, padding, dilation, batch_stats, branch_scale, genstats);
  return {std::move(y), x.alias(), std::move(m), std::move(v)};
}

// eager_unit_with_shortcut's autograd-key kernel: through Node (a ShortcutNode).
template <typename Node>
std::tuple<Tensor, Tensor, Tensor, Tensor> eager_unit_with_shortcut(
    const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& bn_weight,
    const OptTensor& bn_bias, const Tensor& mean, const Tensor& invstd, const OptTensor& residual,
    SymInts stride, SymInts padding, SymInts dilation, bool batch_stats,
    const OptTensor& branch_scale, bool genstats) {
  static const std::string op =
      std::string(Node::Kernels::kNamespace) + ".eager_unit_with_shortcut";
  checks::check_defined(op.c_str(), {{"x", &x}, {"weight", &weight}, {"mean", &mean},
                                     {"invstd", &invstd}});
  auto out = Node::apply(x, weight, bias, bn_weight, bn_bias, mean, invstd, residual, stride,
                         padding, dilation, batch_stats, branch_scale, genstats);
  return {out[0], out[1], out[2], out[3]};
}

// ------------------------------------------------------------------------------------ the pair

// Two convolutions of one BN-ReLU below autograd (eager_pair's schema; its backend-key kernel):
// (y, y2, mean of y2, biased var of y2), the statistics empty unless genstats. No residual, no
// branch scale.
template <typename K>
std::tuple<Tensor, Tensor, Tensor, Tensor> pair_forward(
    const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& weight2,
    const OptTensor& bias2, const OptTensor& bn_weight, const OptTensor& bn_bias,
    const Tensor& mean, const Tensor& invstd, SymInts stride, SymInts padding, SymInts dilation,
    SymInts stride2, SymInts padding2, SymInts dilation2, bool batch_stats, bool genstats) {
  if constexpr (K::kPairKernels) {  // one kernel, which checks every argument
    return K::pair_forward(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd,
                           stride, padding, dilation, stride2, padding2, dilation2, genstats);
  } else {
    // Both convolutions checked before the first runs.
    static const std::string op = std::string(K::kNamespace) + ".eager_pair";
    checks::check_pair_args(op.c_str(), K::kDevice, x, weight, bias, weight2, bias2,
                            bn_weight, bn_bias, mean, invstd, stride, padding, dilation, stride2,
                            padding2, dilation2);
    Tensor y = K::forward(x, weight, bias, bn_weight, bn_bias, mean, invstd, std::nullopt,
                          stride, padding, dilation, batch_stats, std::nullopt);
    auto [y2, m2, v2] = unit_forward<K>(x, weight2, bias2, bn_weight, bn_bias, mean, invstd,
                                        std::nullopt, stride2, padding2, dilation2, batch_stats,
                                        std::nullopt, genstats);
    return {std::move(y), std::move(y2), std::move(m2), std::move(v2)};
  }
}

// The pair's backward as one backward call per convolution (`backward`: an op with
// bn_relu_conv2d_backward's schema), each asked only for its own gradients, the shared ones (x,
// bn_weight, bn_bias) summed: (grad_x, grad_weight, grad_bias, grad_weight2, grad_bias2,
// grad_bn_weight, grad_bn_bias), undefined where not wanted.
template <typename Backward>
Grads7 composed_pair_backward(Backward&& backward, const Tensor& grad, const Tensor& grad2,
                              const Tensor& x, const Tensor& weight, const Tensor& weight2,
                              const OptTensor& bn_weight, const OptTensor& bn_bias,
                              const Tensor& mean, const Tensor& invstd, c10::IntArrayRef geo,
                              bool batch_stats, const std::array<bool, 7>& want) {
  const auto [want_x, want_w, want_b, want_w2, want_b2, want_g, want_beta] = want;
  // A convolution whose output took no gradient (undefined) is not differentiated: its
  // weight and bias get none, and x, bn_weight, bn_bias the other's alone.
  const bool d1 = grad.defined(), d2 = grad2.defined();
  const std::array<bool, 5> m1{d1 && want_x, d1 && want_w, d1 && want_b, d1 && want_g,
                               d1 && want_beta};
  const std::array<bool, 5> m2{d2 && want_x, d2 && want_w2, d2 && want_b2, d2 && want_g,
                               d2 && want_beta};
  const auto sym = [&](int i) { return c10::fromIntArrayRefSlow(geo.slice(i, 2)); };
  Grads5 r1, r2;
  if (any(m1)) {
    r1 = backward(grad, x, weight, bn_weight, bn_bias, mean, invstd, sym(0), sym(2), sym(4),
                  batch_stats, m1, std::nullopt);
  }
  if (any(m2)) {
    r2 = backward(grad2, x, weight2, bn_weight, bn_bias, mean, invstd, sym(6), sym(8), sym(10),
                  batch_stats, m2, std::nullopt);
  }
  // A shared gradient: of both calls, of the one that ran, or of neither.
  const auto sum = [](const Tensor& a, const Tensor& b, bool wanted) {
    if (!wanted) return Tensor();
    return a.defined() && b.defined() ? a + b : (a.defined() ? a : b);
  };
  return {sum(std::get<0>(r1), std::get<0>(r2), want_x), std::get<1>(r1), std::get<2>(r1),
          std::get<1>(r2), std::get<2>(r2), sum(std::get<3>(r1), std::get<3>(r2), want_g),
          sum(std::get<4>(r1), std::get<4>(r2), want_beta)};
}

// Two convolutions of one BN-ReLU (a pre-activation unit's projection shortcut and first
// convolution) as one autograd node (eager_pair; Self names it: EagerCpuPair, EagerCudaPair):
// x, the weights, the BatchNorm parameters and statistics saved once. Outputs (y, y2, mean of
// y2, biased var of y2), the statistics never differentiable. Backward: the kernel set's pair
// kernels, or two backward calls (composed_pair_backward); with a gradient that is not bare,
// the public backward op once per convolution (as fusedres.ops._EagerCpuPair).
template <typename Self, typename K>
struct PairNode : torch::autograd::Function<Self> {
  using Kernels = K;
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const OptTensor& bias, const Tensor& weight2,
                               const OptTensor& bias2, const OptTensor& bn_weight,
                               const OptTensor& bn_bias, const Tensor& mean,
                               const Tensor& invstd, SymInts stride, SymInts padding,
                               SymInts dilation, SymInts stride2, SymInts padding2,
                               SymInts dilation2, bool batch_stats, bool genstats) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, y2, m2, v2] =
        pair_forward<K>(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd,
                        stride, padding, dilation, stride2, padding2, dilation2, batch_stats,
                        genstats);
    const Tensor none;
    ctx->save_for_backward({x, weight, weight2, bn_weight.value_or(none),
                            bn_bias.value_or(none), mean, invstd});
    ctx->saved_data["geometry"] =
        flat_ints({stride, padding, dilation, stride2, padding2, dilation2});
    ctx->saved_data["batch_stats"] = batch_stats;
    // Each input's index among the tensor inputs present (needs_input_grad), -1 when absent.
    int64_t edge = 2;  // x, weight
    const int64_t e_b = present(bias) ? edge++ : -1;
    const int64_t e_w2 = edge++;
    const int64_t e_b2 = present(bias2) ? edge++ : -1;
    const int64_t e_g = present(bn_weight) ? edge++ : -1;
    const int64_t e_beta = present(bn_bias) ? edge : -1;
    ctx->saved_data["edges"] = std::vector<int64_t>{0, 1, e_b, e_w2, e_b2, e_g, e_beta};
    ctx->mark_non_differentiable({m2, v2});
    // As UnitNode's: no zero fill for the statistics' gradients (two a downsampling block's
    // step), nor for a convolution's output that took none (undefined, handled below).
    ctx->set_materialize_grads(false);
    return {y, y2, m2, v2};
  }

  // Gradients in the forward's argument order: x, weight, bias, weight2, bias2, bn_weight,
  // bn_bias, then none (mean, invstd, the geometries, batch_stats, genstats).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1], &weight2 = saved[2], &mean = saved[5],
                 &invstd = saved[6];
    const OptTensor bn_weight = optional(saved[3]), bn_bias = optional(saved[4]);
    const Tensor &grad = grads[0], &grad2 = grads[1];
    variable_list out(17);
    if (!grad.defined() && !grad2.defined()) return out;
    const std::vector<int64_t> edges = ctx->saved_data["edges"].toIntVector();
    std::array<bool, 7> want{};
    for (int i = 0; i < 7; ++i) want[i] = edges[i] >= 0 && ctx->needs_input_grad(edges[i]);
    const auto [want_x, want_w, want_b, want_w2, want_b2, want_g, want_beta] = want;
    const std::array<bool, 5> mask{want_x, want_w || want_w2, want_b || want_b2, want_g,
                                   want_beta};
    if (!any(mask)) return out;
    const std::vector<int64_t> g = ctx->saved_data["geometry"].toIntVector();
    const c10::IntArrayRef geo(g);
    const bool batch_stats = ctx->saved_data["batch_stats"].toBool();
    Grads7 r;
    const auto bare = [](const Tensor& t) { return !t.defined() || bare_gradient(t); };
    if (bare(grad) && bare(grad2)) {
      at::AutoDispatchBelowADInplaceOrView below;
      bool paired = false;
      if constexpr (K::kPairKernels) {
        if (grad.defined() && grad2.defined()) {  // else one convolution's: the unit's kernels
          const auto sym = [&](int i) { return c10::fromIntArrayRefSlow(geo.slice(i, 2)); };
          r = K::pair_backward(grad, grad2, x, weight, weight2, bn_weight, bn_bias, mean,
                               invstd, sym(0), sym(2), sym(4), sym(6), sym(8), sym(10),
                               batch_stats, mask);
          paired = true;
        }
      }
      if (!paired) {
        r = composed_pair_backward(K::backward, grad, grad2, x, weight, weight2, bn_weight,
                                   bn_bias, mean, invstd, geo, batch_stats, want);
      }
    } else {  // the public op once per convolution, whose layers handle the gradients
      r = composed_pair_backward(public_backward, grad, grad2, x, weight, weight2, bn_weight,
                                 bn_bias, mean, invstd, geo, batch_stats, want);
    }
    auto [gx, gw, gb, gw2, gb2, gg, gbeta] = r;
    const Tensor* got[7] = {&gx, &gw, &gb, &gw2, &gb2, &gg, &gbeta};
    for (int i = 0; i < 7; ++i) {
      if (want[i]) out[i] = *got[i];
    }
    return out;
  }
};

// eager_pair's autograd-key kernel: the pair through Node (a PairNode).
template <typename Node>
std::tuple<Tensor, Tensor, Tensor, Tensor> eager_pair(
    const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& weight2,
    const OptTensor& bias2, const OptTensor& bn_weight, const OptTensor& bn_bias,
    const Tensor& mean, const Tensor& invstd, SymInts stride, SymInts padding, SymInts dilation,
    SymInts stride2, SymInts padding2, SymInts dilation2, bool batch_stats, bool genstats) {
  static const std::string op = std::string(Node::Kernels::kNamespace) + ".eager_pair";
  checks::check_defined(op.c_str(), {{"x", &x}, {"weight", &weight}, {"weight2", &weight2},
                                     {"mean", &mean}, {"invstd", &invstd}});
  auto out = Node::apply(x, weight, bias, weight2, bias2, bn_weight, bn_bias, mean, invstd,
                         stride, padding, dilation, stride2, padding2, dilation2, batch_stats,
                         genstats);
  return {out[0], out[1], out[2], out[3]};
}

// ------------------------------------------------------------- a module's forward in one call

// A tensor that the eager route may hand to kernels bare: no layer between it and its data
// (functorch's batching or grad wrappers, a __torch_dispatch__ subclass, functionalization).
inline bool plain(const Tensor& t) {
  constexpr c10::DispatchKeySet layered(
      {c10::DispatchKey::Batched, c10::DispatchKey::FuncTorchBatched,
       c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Python,
       c10::DispatchKey::Functionalize});
  return !t.key_set().has_any(layered);
}

// Whether every tensor argument of module_unit is plain and no dispatch mode is on: else the
// arguments are the Python route's alone (it checks them through their layers).
inline bool plain_arguments(std::initializer_list<const Tensor*> tensors,
                            std::initializer_list<const OptTensor*> optionals) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  for (const Tensor* t : tensors) {
    if (!plain(*t)) return false;
  }
  for (const OptTensor* t : optionals) {
    if (present(*t) && !plain(**t)) return false;
  }
  return true;
}

// Whether module_unit runs these well-formed arguments (checks::check_module_args passed) on
// kernel set K: a subset of what the Python route takes, the rest left to it (module_unit returns
// no result and has touched nothing): x non-empty of a dtype K takes, the weight, bias and
// residual in x's dtype (else autocast's or PyTorch's promotion, which the Python route applies),
// autocast off.
template <typename K>
bool module_unit_accepts(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                         const OptTensor& residual) {
  const auto dt = x.scalar_type();
  if (!(K::on_device(x) && K::takes_dtype(dt) && x.numel() > 0 && weight.size(0) > 0 &&
        weight.scalar_type() == dt)) {
    return false;
  }
  if (at::autocast::is_autocast_enabled(x.device().type())) return false;
  for (const OptTensor* t : {&bias, &residual}) {
    if (present(*t) && (*t)->scalar_type() != dt) return false;
  }
  return true;
}

// A BatchNorm parameter in the statistics dtype, cast as fusedres.functional.prepare_batch_norm
// casts it (Tensor.to: differentiable, so its gradient reaches the parameter in its own dtype).
inline OptTensor in_dtype(const OptTensor& p, at::ScalarType dtype) {
  if (!present(p) || p->scalar_type() == dtype) return p;
  return p->to(dtype);
}

// BNReLUConv2d's forward in one call (fusedres.modules.BNReLUConv2d): the BatchNorm's statistics
// and running-statistics update (K::prepare), then the fused unit through Node (a UnitNode), or
// with grad mode off the forward kernel alone. Arguments that no route takes raise
// (checks::check_module_args), before anything is touched. Returns [y], or [] when
// module_unit_accepts does not take well-formed arguments (a dtype pairing, autocast, a layered
// tensor: nothing touched, the caller's Python route runs them).
template <typename K, typename Node>
std::vector<Tensor> module_unit(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                const OptTensor& bn_weight, const OptTensor& bn_bias,
                                const OptTensor& running_mean, const OptTensor& running_var,
                                const OptTensor& num_batches_tracked, bool training,
                                std::optional<double> momentum, double eps,
                                const OptTensor& residual, SymInts stride, SymInts padding,
                                SymInts dilation) {
  if (!plain_arguments({&x, &weight}, {&bias, &bn_weight, &bn_bias, &running_mean, &running_var,
                                       &num_batches_tracked, &residual})) {
    return {};
  }
  static const std::string op = std::string(K::kNamespace) + ".module_unit";
  checks::check_module_args(op.c_str(), K::kDevice, x, weight, bias, bn_weight, bn_bias,
                            running_mean, running_var, num_batches_tracked, training, momentum,
                            eps, residual, stride, padding, dilation);
  if (!module_unit_accepts<K>(x, weight, bias, residual)) return {};
  Tensor mean, invstd;
  {
    at::AutoDispatchBelowAutograd below;
    std::tie(mean, invstd) = K::prepare(x, running_mean, running_var, num_batches_tracked,
                                        training, momentum, eps, std::nullopt, std::nullopt);
  }
  const bool batch_stats = training || !present(running_mean);
  const at::ScalarType sdt = mean.scalar_type();
  const OptTensor gamma = in_dtype(bn_weight, sdt), beta = in_dtype(bn_bias, sdt);
  if (!at::GradMode::is_enabled()) {  // no graph to record (and inference tensors stay unsaved)
    at::AutoDispatchBelowADInplaceOrView below;
    return {K::forward(x, weight, bias, gamma, beta, mean, invstd, residual, stride, padding,
                       dilation, batch_stats, std::nullopt)};
  }
  return {std::get<0>(eager_unit<Node>(x, weight, bias, gamma, beta, mean, invstd, residual,
                                       stride, padding, dilation, batch_stats, std::nullopt,
                                       false))};
}

// prepare_batch_norm's autograd-key kernel: nothing in it is differentiated (the unit's backward
// folds the statistics' gradient into x's), so it runs K::prepare below autograd, the in-place
// updates still counted by the running statistics' version counters.
template <typename K>
std::tuple<Tensor, Tensor> prepare_below_autograd(
    const Tensor& x, const OptTensor& running_mean, const OptTensor& running_var,
    const OptTensor& num_batches_tracked, bool training, std::optional<double> momentum,
    double eps, const OptTensor& mean, const OptTensor& var) {
  at::AutoDispatchBelowAutograd below;
  return K::prepare(x, running_mean, running_var, num_batches_tracked, training, momentum, eps,
                    mean, var);
}

}  // namespace fusedres::eager
