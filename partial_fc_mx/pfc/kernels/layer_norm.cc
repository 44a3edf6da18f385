// LayerNorm over the last axis, forward and backward, for the ViTs' training graph on the
// CPU (partial_fc_mx/run/cpu_kernels.py puts it in place of MXNet's LayerNorm).
//
// MXNet 1.9's CPU LayerNorm backward reduces its gradients with generic broadcast
// expressions, row by row through broadcast indexing: 0.69 s of a vit_t step at batch
// 16 on one thread, 14 times its forward (docs/benchmarks.md). Here a row is one
// contiguous, vectorized pass each way.
//
// pfc_layer_norm(data, gamma, beta) -> (out, mean, rstd): data (..., D) float32, gamma and
// beta (D,); each row of D values x gives out = (x - mean) * rstd * gamma + beta, mean and
// the variance over the row in float (as MXNet's), rstd = 1 / sqrt(variance + eps); mean
// and rstd are kept for the backward, shaped as data with a last axis of 1. The backward
// gives data's gradient, gamma's and beta's: each block of BLOCK rows summed in float in
// row order, the blocks in double in block order (the same bits at any thread count).
// Attributes: eps; `threads` as rows.cc's operators. It writes its gradients; it never
// adds to them (prelu.cc says why).

#include <algorithm>
#include <cmath>

#include "common.h"

namespace {

constexpr int64_t BLOCK = 64;  // rows per partial sum of gamma's and beta's gradients

struct Rows {
  int64_t count, width;
};

Rows rows_of(const MXTensor& data) {
  Rows rows{1, int64_t(data.shape.back())};
  for (size_t axis = 0; axis + 1 < data.shape.size(); ++axis) rows.count *= data.shape[axis];
  return rows;
}

PFC_CLONES void normalize_row(const float* x, const float* gamma, const float* beta, float eps,
                              int64_t width, float* y, float* mean_out, float* rstd_out) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < width; ++k) sum += x[k];
  const float mean = sum / float(width);
  float squares = 0;
#pragma omp simd reduction(+ : squares)
  for (int64_t k = 0; k < width; ++k) squares += (x[k] - mean) * (x[k] - mean);
  const float rstd = 1.0f / std::sqrt(squares / float(width) + eps);
#pragma omp simd
  for (int64_t k = 0; k < width; ++k) y[k] = (x[k] - mean) * rstd * gamma[k] + beta[k];
  *mean_out = mean;
  *rstd_out = rstd;
}

// dx for one row, and the row's shares of gamma's and beta's gradients added to the
// block's sums: with xhat = (x - mean) * rstd and g = dy * gamma,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
PFC_CLONES void row_backward(const float* dy, const float* x, const float* gamma, float mean,
                             float rstd, int64_t width, float* dx, float* gamma_sum,
                             float* beta_sum) {
  float g_sum = 0, gx_sum = 0;
#pragma omp simd reduction(+ : g_sum, gx_sum)
  for (int64_t k = 0; k < width; ++k) {
    const float xhat = (x[k] - mean) * rstd;
    const float g = dy[k] * gamma[k];
    g_sum += g;
    gx_sum += g * xhat;
    gamma_sum[k] += dy[k] * xhat;
    beta_sum[k] += dy[k];
  }
  const float g_mean = g_sum / float(width), gx_mean = gx_sum / float(width);
#pragma omp simd
  for (int64_t k = 0; k < width; ++k) {
    const float xhat = (x[k] - mean) * rstd;
    dx[k] = rstd * (dy[k] * gamma[k] - g_mean - xhat * gx_mean);
  }
}

MXReturnValue layer_norm_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "layer_norm", {"eps"}, 3, 3, inputs, outputs);
}

// gamma's and beta's shapes are inferred where the graph leaves them open (unknown, or
// a length of 0: not yet known), as LayerNorm's are.
MXReturnValue layer_norm_shapes(const Attributes&, Shapes* in, Shapes* out) {
  const auto& data = (*in)[0];
  if (data.empty()) {
    MX_ERROR_MSG << "layer_norm needs data of at least one axis";
    return MX_FAIL;
  }
  for (int parameter : {1, 2}) {
    auto& shape = (*in)[parameter];
    if (shape.empty() || (shape.size() == 1 && shape[0] == 0)) shape = {data.back()};
    if (shape.size() != 1 || shape[0] != data.back()) {
      MX_ERROR_MSG << "layer_norm needs gamma and beta of the data's last axis, "
                   << data.back();
      return MX_FAIL;
    }
  }
  auto statistics = data;
  statistics.back() = 1;
  (*out)[0] = data;
  (*out)[1] = statistics;
  (*out)[2] = statistics;
  return MX_SUCCESS;
}

MXReturnValue layer_norm_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                                 std::vector<MXTensor>* out, const OpResource&) {
  float eps = 0;
  if (read_numbers(attributes, "layer_norm", {{"eps", &eps}}) != MX_SUCCESS) return MX_FAIL;
  const Rows rows = rows_of((*in)[0]);
  const float* x = (*in)[0].data<float>();
  const float* gamma = (*in)[1].data<float>();
  const float* beta = (*in)[2].data<float>();
  float* y = (*out)[0].data<float>();
  float* mean = (*out)[1].data<float>();
  float* rstd = (*out)[2].data<float>();
  for_each_row(attributes, rows.count, [&](int64_t r) {
    normalize_row(x + r * rows.width, gamma, beta, eps, rows.width, y + r * rows.width,
                  mean + r, rstd + r);
  });
  return MX_SUCCESS;
}

// inputs (the gradients of out, mean and rstd; data, gamma, beta; out, mean, rstd) ->
// (data's gradient, gamma's, beta's). Nothing downstream reads mean and rstd: their
// gradients are not used.
MXReturnValue layer_norm_backward(const Attributes& attributes, std::vector<MXTensor>* in,
                                  std::vector<MXTensor>* out, const OpResource&) {
  const Rows rows = rows_of((*in)[3]);
  const float* dy = (*in)[0].data<float>();
  const float* x = (*in)[3].data<float>();
  const float* gamma = (*in)[4].data<float>();
  const float* mean = (*in)[7].data<float>();
  const float* rstd = (*in)[8].data<float>();
  float* dx = (*out)[0].data<float>();
  const int64_t blocks = (rows.count + BLOCK - 1) / BLOCK;
  // each block's sums: gamma's in the first half of its 2 x width floats, beta's after
  std::vector<float> sums(size_t(blocks * 2 * rows.width), 0.0f);
  for_each_row(attributes, blocks, [&](int64_t b) {
    float* gamma_sum = sums.data() + b * 2 * rows.width;
    float* beta_sum = gamma_sum + rows.width;
    const int64_t end = std::min(rows.count, (b + 1) * BLOCK);
    for (int64_t r = b * BLOCK; r < end; ++r) {
      row_backward(dy + r * rows.width, x + r * rows.width, gamma, mean[r], rstd[r],
                   rows.width, dx + r * rows.width, gamma_sum, beta_sum);
    }
  });
  float* gamma_grad = (*out)[1].data<float>();
  float* beta_grad = (*out)[2].data<float>();
  for_each_row(attributes, rows.width, [&](int64_t k) {
    double gamma_total = 0, beta_total = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      gamma_total += sums[size_t(b * 2 * rows.width + k)];
      beta_total += sums[size_t(b * 2 * rows.width + rows.width + k)];
    }
    gamma_grad[k] = float(gamma_total);
    beta_grad[k] = float(beta_total);
  });
  return MX_SUCCESS;
}

}  // namespace

REGISTER_OP(pfc_layer_norm)
    .setParseAttrs(layer_norm_arity)
    .setInferType(all_float32)
    .setInferShape(layer_norm_shapes)
    .setForward(layer_norm_forward, "cpu")
    .setBackward(layer_norm_backward, "cpu");
