// PReLU with a slope per channel, forward and backward, for the backbones' training graph
// on the CPU (partial_fc_mx/run/cpu_kernels.py puts it in place of MXNet's LeakyReLU).
//
// MXNet 1.9 computes act_type="prelu" outside oneDNN, with mshadow expressions whose
// backward reduces the slopes' gradient element by element through broadcast indexing:
// in MobileFaceNet that backward was 68% of a training step on this project's CPUs
// (docs/parity.md). Here each (sample, channel) plane is one contiguous, vectorized pass.
//
// pfc_prelu(data, slopes) -> out: data (N, C, ...) float32, slopes (C,) or (1,) float32;
// out = data where data > 0, else slope * data, as LeakyReLU's; a NaN stays NaN. Its
// backward gives data's gradient and the slopes': each plane's share summed in float,
// a slope's planes in double in a fixed order (the same bits at any thread count).
// Attribute `threads` as rows.cc's operators.
//
// It writes its gradients; it never adds to them: MXNet 1.9's library API does not pass
// an operator the request to add (grad_req="add"), so precision.training_model keeps
// LeakyReLU for a network with such a parameter.

#include "common.h"

namespace {

PFC_CLONES void prelu_plane(const float* x, float slope, float* y, int64_t size) {
#pragma omp simd
  for (int64_t k = 0; k < size; ++k) y[k] = x[k] > 0 ? x[k] : slope * x[k];
}

// dx for one plane, and the plane's share of its slope's gradient: sum of dy * x where
// x is not positive.
PFC_CLONES float prelu_plane_backward(const float* dy, const float* x, float slope, float* dx,
                                      int64_t size) {
  float slope_grad = 0;
#pragma omp simd reduction(+ : slope_grad)
  for (int64_t k = 0; k < size; ++k) {
    const bool positive = x[k] > 0;
    dx[k] = positive ? dy[k] : slope * dy[k];
    slope_grad += (positive ? 0.0f : x[k]) * dy[k];  // as MXNet's: an infinite dy gives NaN
  }
  return slope_grad;
}

// data as (samples, channels, plane size): a plane of (N, C, H, W) is one H x W image of
// a channel; of (N, C) one number.
struct Planes {
  int64_t samples, channels, size;
};

Planes planes_of(const MXTensor& data) {
  Planes planes{int64_t(data.shape[0]), int64_t(data.shape[1]), 1};
  for (size_t axis = 2; axis < data.shape.size(); ++axis) planes.size *= data.shape[axis];
  return planes;
}

MXReturnValue prelu_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "prelu", {}, 2, 1, inputs, outputs);
}

// The slopes' shape is inferred where the graph leaves it open, as LeakyReLU's is.
MXReturnValue prelu_shapes(const Attributes&, Shapes* in, Shapes* out) {
  const auto& data = (*in)[0];
  auto& slopes = (*in)[1];
  if (data.size() >= 2 && slopes.empty()) slopes = {data[1]};
  if (data.size() < 2 || slopes.size() != 1 || (slopes[0] != data[1] && slopes[0] != 1)) {
    MX_ERROR_MSG << "prelu needs (N, C, ...) data and C slopes (or one)";
    return MX_FAIL;
  }
  (*out)[0] = data;
  return MX_SUCCESS;
}

MXReturnValue prelu_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                            std::vector<MXTensor>* out, const OpResource&) {
  const Planes planes = planes_of((*in)[0]);
  const float* x = (*in)[0].data<float>();
  const float* slopes = (*in)[1].data<float>();
  const bool shared = (*in)[1].shape[0] == 1 && planes.channels != 1;
  float* y = (*out)[0].data<float>();
  for_each_row(attributes, planes.samples * planes.channels, [&](int64_t p) {
    const float slope = slopes[shared ? 0 : p % planes.channels];
    prelu_plane(x + p * planes.size, slope, y + p * planes.size, planes.size);
  });
  return MX_SUCCESS;
}

// inputs (out's gradient, data, slopes) -> (data's gradient, the slopes')
MXReturnValue prelu_backward(const Attributes& attributes, std::vector<MXTensor>* in,
                             std::vector<MXTensor>* out, const OpResource&) {
  const Planes planes = planes_of((*in)[1]);
  const float* dy = (*in)[0].data<float>();
  const float* x = (*in)[1].data<float>();
  const float* slopes = (*in)[2].data<float>();
  const bool shared = (*in)[2].shape[0] == 1 && planes.channels != 1;
  float* dx = (*out)[0].data<float>();
  std::vector<double> channel_grad(planes.channels);
  // a thread per channel: each channel's planes summed by one thread, in sample order
  for_each_row(attributes, planes.channels, [&](int64_t c) {
    const float slope = slopes[shared ? 0 : c];
    double sum = 0;
    for (int64_t n = 0; n < planes.samples; ++n) {
      const int64_t at = (n * planes.channels + c) * planes.size;
      sum += prelu_plane_backward(dy + at, x + at, slope, dx + at, planes.size);
    }
    channel_grad[c] = sum;
  });
  float* slope_grad = (*out)[1].data<float>();
  if (shared) {
    double sum = 0;
    for (double g : channel_grad) sum += g;
    slope_grad[0] = float(sum);
  } else {
    for (int64_t c = 0; c < planes.channels; ++c) slope_grad[c] = float(channel_grad[c]);
  }
  return MX_SUCCESS;
}

}  // namespace

REGISTER_OP(pfc_prelu)
    .setParseAttrs(prelu_arity)
    .setInferType(all_float32)
    .setInferShape(prelu_shapes)
    .setForward(prelu_forward, "cpu")
    .setBackward(prelu_backward, "cpu");
