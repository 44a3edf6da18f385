// The row-wise passes of one Partial FC step, fused for the CPU (partial_fc_mx/pfc/rows.py),
// and the SGD update of its sampled centers (pfc/center_optimizers/sgd.py).
//
// Composed of MXNet operators, each of these passes is 2-5 operators, and each operator
// is a pass of its own over an N x n or n x D matrix: at N = 1024 and 50,000 sampled
// centers that is 200 MB a pass. Here each row is read from memory once and worked on
// while it sits in the core's cache. Built and loaded by kernels/__init__.py through
// MXNet's library API (mx.library.load): the operators run on MXNet's engine, in order
// with the rest of the step, like any other.
//
// float32 only. Every operator takes the attribute `threads` (OpenMP threads, the count
// MXNet's own operators use in this process) and is called with its first output being
// its first input (in place) or a buffer of the Python side.

#include <cmath>
#include <cstring>

#include "common.h"

namespace {

// exp(x) for x <= 0 to within 2 ulp (tests/test_rows.py measures it), in a form the
// compiler vectorizes (the C library's expf is a call per element): x = k ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts, so that k ln2_hi is exact), exp(r) by its Taylor
// series to r^7 (the remainder is below 6e-9 of the value), times 2^k. x below -87
// gives 0: exp(-87) = 1.6e-38 is next to float32's least normal number, and the
// softmax adds it to a sum of at least 1 (the row's max), where it counts for nothing.
// A NaN stays NaN.
inline float exp_nonpositive(float x) {
  const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float k = (x * 1.44269504088896341f + round) - round;
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^k from its exponent bits, k bounded first by comparisons (fmin and fmax stay
  // calls): a NaN k becomes -127 here, and the NaN stays in p
  float bounded = k > -127.0f ? k : -127.0f;
  bounded = bounded < 128.0f ? bounded : 128.0f;
  const int32_t e = static_cast<int32_t>(bounded) + 127;
  const int32_t bits = e << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return x < -87.0f ? 0.0f : p * two_k;
}

// The row's max over all but its last entry (NaN skipped, as MXNet's CPU max pooling
// does), then the softmax of the whole row with the last entry set to that max: the
// spare center's column, whose probability is then 1 / (1 + this rank's exp-sum).
// With `filter` (inter-class filtering, arcface_torch's rule): every entry above
// `threshold` but the row's target column (`target`, -1: none here) counts as 0 in the
// max and the exp-sum, and its probability is 0 (no gradient); *filtered counts them.
template <bool filter>
PFC_CLONES void softmax_with_spare_row(const float* in, float* out, int64_t width,
                                       float threshold, int64_t target, float* row_max,
                                       float* filtered) {
  float m = -INFINITY;
  float count = 0;
#pragma omp simd reduction(max : m) reduction(+ : count)
  for (int64_t j = 0; j < width - 1; ++j) {
    const bool dirty = filter && in[j] > threshold && j != target;
    const float x = dirty ? 0.0f : in[j];
    m = x > m ? x : m;
    count += dirty ? 1.0f : 0.0f;
  }
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < width - 1; ++j) {
    const bool dirty = filter && in[j] > threshold && j != target;
    const float e = exp_nonpositive((dirty ? 0.0f : in[j]) - m);
    sum += e;
    out[j] = dirty ? 0.0f : e;
  }
  out[width - 1] = 1.0f;
  const float inverse = 1.0f / (sum + 1.0f);
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) out[j] *= inverse;
  *row_max = m;
  if (filter) *filtered = count;
}

// Sub-center ArcFace: each class's logit is the max of its K sub-centers' (K
// consecutive entries of the row), a NaN among them kept (the step's check needs it).
// K is a template argument, so that the compiler unrolls the K entries and vectorizes
// across classes (loads of stride K): with K read at run time the loop ran 20x slower
// than the softmax's pass over the same entries (334 against 17 ms at 1024 x 60,000).
template <int K>
PFC_CLONES void subcenter_max_row(const float* in, float* out, int64_t classes) {
#pragma omp simd
  for (int64_t c = 0; c < classes; ++c) {
    float m = in[c * K];
    bool nan = m != m;
    for (int j = 1; j < K; ++j) {
      const float x = in[c * K + j];
      m = x > m ? x : m;
      nan = nan || x != x;
    }
    out[c] = nan ? NAN : m;
  }
}

// Back to the sub-centers' entries, in place over their logits: each class's
// probability to its first sub-center of the largest logit (the max's), 0 to the others.
template <int K>
PFC_CLONES void subcenter_scatter_row(float* rows, const float* prob, int64_t classes) {
  constexpr int64_t kBlock = 256;  // classes at a time: their choices stay on the stack
  float chosen[K][kBlock];
  for (int64_t low = 0; low < classes; low += kBlock) {
    const int64_t count = classes - low < kBlock ? classes - low : kBlock;
    float* entries = rows + low * K;
#pragma omp simd
    for (int64_t c = 0; c < count; ++c) {
      float top = entries[c * K];
      int best = 0;
      for (int j = 1; j < K; ++j) {
        const float x = entries[c * K + j];
        best = x > top ? j : best;
        top = x > top ? x : top;
      }
      for (int j = 0; j < K; ++j) chosen[j][c] = j == best ? prob[low + c] : 0.0f;
    }
#pragma omp simd
    for (int64_t c = 0; c < count; ++c) {
      for (int j = 0; j < K; ++j) entries[c * K + j] = chosen[j][c];
    }
  }
}

// The most sub-centers per class: MAX_SUBCENTERS of pfc/centers.py.
constexpr int kMaxSubcenters = 16;

// Either row pass with K from 2 to kMaxSubcenters, as a function of (row, classes): the
// one instance for this K (the operators check k first).
template <template <int> class Pass, int K = 2>
auto subcenter_pass(int64_t k) {
  if constexpr (K < kMaxSubcenters) {
    if (k != K) return subcenter_pass<Pass, K + 1>(k);
  }
  return Pass<K>::run;
}

template <int K>
struct MaxPass {
  static void run(float* rows, const float* in, float* out, int64_t classes) {
    (void)rows;
    subcenter_max_row<K>(in, out, classes);
  }
};

template <int K>
struct ScatterPass {
  static void run(float* rows, const float* prob, float* out, int64_t classes) {
    (void)out;
    subcenter_scatter_row<K>(rows, prob, classes);
  }
};

// grad = scale * (grad - (grad . w) / |w|^2 * w) for one row: its part along w removed.
PFC_CLONES void project_row(const float* grad, const float* w, float inverse_square_norm,
                            float scale, float* out, int64_t width) {
  double dot = 0;  // in double, as the norms: one row's sums cost little, and the
#pragma omp simd reduction(+ : dot)  // tests' ill-conditioned steps need the digits
  for (int64_t j = 0; j < width; ++j) dot += double(grad[j]) * w[j];
  const float along = float(dot * inverse_square_norm);
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) out[j] = scale * (grad[j] - along * w[j]);
}

// v = w * s / |w| for one row, and s / |w|. The sum of squares in double: the steps
// whose softmax is near 1 at the target (p - 1 cancels) amplify every rounding here.
PFC_CLONES void scale_row(const float* w, float s, float* v, float* row_scale, int64_t width) {
  double square_norm = 0;
#pragma omp simd reduction(+ : square_norm)
  for (int64_t j = 0; j < width; ++j) square_norm += double(w[j]) * w[j];
  const float scale = float(s / std::sqrt(square_norm));
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) v[j] = w[j] * scale;
  *row_scale = scale;
}

// SGD with momentum and weight decay on one sampled row of the centers, in place in
// the shard: m = momentum m - lr (g + wd w); w += m, in the order of MXNet's own
// sgd_mom_update and without fused multiply-adds: its bits, wherever MXNet's attribute
// parser reads lr to the same float as strtof (its own parser can be 1 ulp off).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
PFC_CLONES void sgd_momentum_row(float* w, float* m, const float* g, float lr, float momentum,
                                 float wd, int64_t width) {
  const float rate = lr * wd;
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) {
    m[j] = momentum * m[j] - rate * w[j] - lr * g[j];
    w[j] += m[j];
  }
}
#pragma GCC pop_options

// [w; m] <- [[a, b], [c, d]] [w; m] for one row and its momentum, p = (a, b, c, d): the
// momentum and weight-decay steps the row missed while not sampled (pfc/idle_rows.py).
PFC_CLONES void replay_row(float* w, float* m, const float* p, int64_t width) {
  const float a = p[0], b = p[1], c = p[2], d = p[3];
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) {
    const float wj = w[j], mj = m[j];
    w[j] = a * wj + b * mj;
    m[j] = c * wj + d * mj;
  }
}


// ---- what MXNet asks of every operator: inputs, outputs, their types and shapes ----

bool is_matrix(const std::vector<unsigned int>& shape) { return shape.size() == 2; }

// softmax_with_spare(logits) -> (probabilities, row maxima)
MXReturnValue softmax_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "softmax_with_spare", {}, 1, 2, inputs, outputs);
}

// The shapes of an operator that takes a matrix and gives one like it and a value per row.
MXReturnValue matrix_and_one_per_row(const Shapes& in, Shapes* out, unsigned int least_width,
                                     const char* what_is_needed) {
  if (!is_matrix(in[0]) || in[0][1] < least_width) {
    MX_ERROR_MSG << what_is_needed;
    return MX_FAIL;
  }
  (*out)[0] = in[0];
  (*out)[1] = {in[0][0]};
  return MX_SUCCESS;
}

MXReturnValue softmax_shapes(const Attributes&, Shapes* in, Shapes* out) {
  return matrix_and_one_per_row(*in, out, 2, "softmax_with_spare needs an N x (n + 1) matrix");
}

MXReturnValue softmax_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                              std::vector<MXTensor>* out, const OpResource&) {
  const float* logits = (*in)[0].data<float>();
  float* prob = (*out)[0].data<float>();
  float* row_max = (*out)[1].data<float>();
  const int64_t width = (*in)[0].shape[1];
  for_each_row(attributes, (*in)[0].shape[0], [&](int64_t i) {
    softmax_with_spare_row<false>(logits + i * width, prob + i * width, width, 0, -1,
                                  row_max + i, nullptr);
  });
  return MX_SUCCESS;
}

// filtered_softmax_with_spare(logits, target columns int64 N, threshold=) ->
// (probabilities, row maxima, entries filtered per row)
MXReturnValue filtered_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "filtered_softmax_with_spare", {"threshold"}, 2, 3, inputs, outputs);
}

MXReturnValue filtered_types(const Attributes&, std::vector<int>* in_types,
                             std::vector<int>* out_types) {
  if ((*in_types)[0] != kFloat32 || (*in_types)[1] != kInt64) {
    MX_ERROR_MSG << "filtered_softmax_with_spare takes float32 logits and int64 columns";
    return MX_FAIL;
  }
  for (int& type : *out_types) type = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue filtered_shapes(const Attributes&, Shapes* in, Shapes* out) {
  if (!is_matrix((*in)[0]) || (*in)[0][1] < 2 ||
      (*in)[1] != std::vector<unsigned int>{(*in)[0][0]}) {
    MX_ERROR_MSG << "filtered_softmax_with_spare needs an N x (n + 1) matrix and N columns";
    return MX_FAIL;
  }
  (*out)[0] = (*in)[0];
  (*out)[1] = {(*in)[0][0]};
  (*out)[2] = {(*in)[0][0]};
  return MX_SUCCESS;
}

MXReturnValue filtered_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource&) {
  const float* logits = (*in)[0].data<float>();
  const int64_t* target = (*in)[1].data<int64_t>();
  float* prob = (*out)[0].data<float>();
  float* row_max = (*out)[1].data<float>();
  float* filtered = (*out)[2].data<float>();
  float threshold;
  if (read_numbers(attributes, "filtered_softmax_with_spare", {{"threshold", &threshold}}) !=
      MX_SUCCESS)
    return MX_FAIL;
  const int64_t width = (*in)[0].shape[1];
  for_each_row(attributes, (*in)[0].shape[0], [&](int64_t i) {
    softmax_with_spare_row<true>(logits + i * width, prob + i * width, width, threshold,
                                 target[i], row_max + i, filtered + i);
  });
  return MX_SUCCESS;
}

// subcenter_max(sub-center logits N x nK, classes N x (n + 1), k=) -> classes: the
// first n columns of each row written (the last is the spare's, the softmax's to set)
MXReturnValue subcenter_max_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "subcenter_max", {"k"}, 2, 1, inputs, outputs);
}

// subcenter_scatter(sub-center logits N x nK, probabilities N x (n + 1), k=) -> the
// first, in place
MXReturnValue subcenter_scatter_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "subcenter_scatter", {"k"}, 2, 1, inputs, outputs);
}

bool k_in_range(int64_t k) { return k >= 2 && k <= kMaxSubcenters; }

// Sub-centers per class, the attribute k, within the instances compiled.
MXReturnValue read_k(const Attributes& attributes, const char* op, int64_t* k) {
  float value;
  if (read_numbers(attributes, op, {{"k", &value}}) != MX_SUCCESS) return MX_FAIL;
  *k = int64_t(value);
  if (!k_in_range(*k)) {
    MX_ERROR_MSG << op << ": k = " << *k << ", not in 2.." << kMaxSubcenters;
    return MX_FAIL;
  }
  return MX_SUCCESS;
}

// Both: N x nK sub-center entries beside N x (n + 1) class entries; the output is the
// operator's own (the classes for the max, the sub-centers for the scatter).
MXReturnValue subcenter_shapes(const Attributes& attributes, const char* op, int output,
                               Shapes* in, Shapes* out) {
  int64_t k;
  if (read_k(attributes, op, &k) != MX_SUCCESS) return MX_FAIL;
  const auto &sub = (*in)[0], &classes = (*in)[1];
  if (!is_matrix(sub) || !is_matrix(classes) || sub[0] != classes[0] ||
      classes[1] < 1 || int64_t(sub[1]) != k * (int64_t(classes[1]) - 1)) {
    MX_ERROR_MSG << op << " needs N x nK sub-center entries and N x (n + 1) class entries";
    return MX_FAIL;
  }
  (*out)[0] = (*in)[output];
  return MX_SUCCESS;
}

MXReturnValue subcenter_max_shapes(const Attributes& attributes, Shapes* in, Shapes* out) {
  return subcenter_shapes(attributes, "subcenter_max", 1, in, out);
}

MXReturnValue subcenter_scatter_shapes(const Attributes& attributes, Shapes* in, Shapes* out) {
  return subcenter_shapes(attributes, "subcenter_scatter", 0, in, out);
}

MXReturnValue subcenter_max_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                                    std::vector<MXTensor>* out, const OpResource&) {
  int64_t k;
  if (read_k(attributes, "subcenter_max", &k) != MX_SUCCESS) return MX_FAIL;
  const float* rows = (*in)[0].data<float>();
  float* classes = (*out)[0].data<float>();
  const int64_t width = (*in)[1].shape[1], sub_width = (*in)[0].shape[1];
  const auto pass = subcenter_pass<MaxPass>(k);
  for_each_row(attributes, (*in)[0].shape[0], [&](int64_t i) {
    pass(nullptr, rows + i * sub_width, classes + i * width, width - 1);
  });
  return MX_SUCCESS;
}

MXReturnValue subcenter_scatter_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                                        std::vector<MXTensor>* out, const OpResource&) {
  int64_t k;
  if (read_k(attributes, "subcenter_scatter", &k) != MX_SUCCESS) return MX_FAIL;
  if ((*out)[0].data<float>() != (*in)[0].data<float>()) {
    MX_ERROR_MSG << "subcenter_scatter works in place: call it with out=its first input";
    return MX_FAIL;
  }
  float* rows = (*out)[0].data<float>();
  const float* prob = (*in)[1].data<float>();
  const int64_t width = (*in)[1].shape[1], sub_width = (*in)[0].shape[1];
  const auto pass = subcenter_pass<ScatterPass>(k);
  for_each_row(attributes, (*in)[0].shape[0], [&](int64_t i) {
    pass(rows + i * sub_width, prob + i * width, nullptr, width - 1);
  });
  return MX_SUCCESS;
}

// project_rows(grad, w, inverse_square_norms, row_scale) -> grad projected
MXReturnValue project_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "project_rows", {}, 4, 1, inputs, outputs);
}

MXReturnValue project_shapes(const Attributes&, Shapes* in, Shapes* out) {
  const auto& grad = (*in)[0];
  if (!is_matrix(grad) || (*in)[1] != grad || (*in)[2] != std::vector<unsigned int>{grad[0]} ||
      (*in)[3] != std::vector<unsigned int>{grad[0]}) {
    MX_ERROR_MSG << "project_rows needs two n x D matrices and two n-vectors";
    return MX_FAIL;
  }
  (*out)[0] = grad;
  return MX_SUCCESS;
}

MXReturnValue project_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                              std::vector<MXTensor>* out, const OpResource&) {
  const float* grad = (*in)[0].data<float>();
  const float* w = (*in)[1].data<float>();
  const float* inverse_square_norms = (*in)[2].data<float>();
  const float* row_scale = (*in)[3].data<float>();
  float* result = (*out)[0].data<float>();
  const int64_t width = (*in)[0].shape[1];
  for_each_row(attributes, (*in)[0].shape[0], [&](int64_t i) {
    project_row(grad + i * width, w + i * width, inverse_square_norms[i], row_scale[i],
                result + i * width, width);
  });
  return MX_SUCCESS;
}

// scale_rows(w, scale=s) -> (w * s / |w|, s / |w|)
MXReturnValue scale_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "scale_rows", {"scale"}, 1, 2, inputs, outputs);
}

MXReturnValue scale_shapes(const Attributes&, Shapes* in, Shapes* out) {
  return matrix_and_one_per_row(*in, out, 1, "scale_rows needs an n x D matrix");
}

MXReturnValue scale_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                            std::vector<MXTensor>* out, const OpResource&) {
  const float* w = (*in)[0].data<float>();
  float* v = (*out)[0].data<float>();
  float* row_scale = (*out)[1].data<float>();
  float s;
  if (read_numbers(attributes, "scale_rows", {{"scale", &s}}) != MX_SUCCESS) return MX_FAIL;
  const int64_t width = (*in)[0].shape[1];
  for_each_row(attributes, (*in)[0].shape[0], [&](int64_t i) {
    scale_row(w + i * width, s, v + i * width, row_scale + i, width);
  });
  return MX_SUCCESS;
}

// The operators that move sampled rows of the shard and their momentum in place:
// (weight R x D, mom R x D, index n int64, one float32 row of `per_row` numbers per
// index: the gradient, n x D, or a 2 x 2, n x 4) -> weight, and mom (mutated). The rows
// must be distinct (a step's sample is), and `out` must be the weight itself.
MXReturnValue row_update_types(const char* op, const char* per_row, std::vector<int>* in_types,
                               std::vector<int>* out_types) {
  const auto& t = *in_types;
  if (t[0] != kFloat32 || t[1] != kFloat32 || t[2] != kInt64 || t[3] != kFloat32) {
    MX_ERROR_MSG << op << " takes float32 weight, momentum and " << per_row
                 << ", and an int64 index";
    return MX_FAIL;
  }
  (*out_types)[0] = kFloat32;
  return MX_SUCCESS;
}

// per_row_width 0: as wide as the weight.
MXReturnValue row_update_shapes(const char* op, const char* per_row, unsigned int per_row_width,
                                Shapes* in, Shapes* out) {
  const auto &weight = (*in)[0], &rows = (*in)[3];
  const unsigned int width = per_row_width ? per_row_width : (is_matrix(weight) ? weight[1] : 0);
  if (!is_matrix(weight) || (*in)[1] != weight || !is_matrix(rows) || rows[1] != width ||
      (*in)[2] != std::vector<unsigned int>{rows[0]}) {
    MX_ERROR_MSG << op << " needs an R x D weight and momentum, n indices and " << per_row;
    return MX_FAIL;
  }
  (*out)[0] = weight;
  return MX_SUCCESS;
}

MXReturnValue row_update_mutates(const Attributes&, std::vector<int>* input_indices) {
  input_indices->push_back(1);  // the momentum
  return MX_SUCCESS;
}

// Every index inside the weight's rows, and the output the weight itself.
MXReturnValue rows_in_place(const char* op, std::vector<MXTensor>* in,
                            std::vector<MXTensor>* out) {
  const int64_t* index = (*in)[2].data<int64_t>();
  const int64_t rows = (*in)[0].shape[0], sampled = (*in)[3].shape[0];
  for (int64_t k = 0; k < sampled; ++k) {
    if (index[k] < 0 || index[k] >= rows) {
      MX_ERROR_MSG << op << ": index " << index[k] << " is outside the " << rows << " rows";
      return MX_FAIL;
    }
  }
  if ((*out)[0].data<float>() != (*in)[0].data<float>()) {
    MX_ERROR_MSG << op << " updates in place: call it with out=weight";
    return MX_FAIL;
  }
  return MX_SUCCESS;
}

// sgd_momentum_rows(weight, mom, index, grad, lr=, momentum=, wd=): sgd_momentum_row on
// each row `index`, with the gradient's rows in the index's order.
MXReturnValue sgd_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "sgd_momentum_rows", {"lr", "momentum", "wd"}, 4, 1, inputs, outputs);
}

MXReturnValue sgd_types(const Attributes&, std::vector<int>* in_types,
                        std::vector<int>* out_types) {
  return row_update_types("sgd_momentum_rows", "gradient", in_types, out_types);
}

MXReturnValue sgd_shapes(const Attributes&, Shapes* in, Shapes* out) {
  return row_update_shapes("sgd_momentum_rows", "an n x D gradient", 0, in, out);
}

MXReturnValue sgd_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource&) {
  if (rows_in_place("sgd_momentum_rows", in, out) != MX_SUCCESS) return MX_FAIL;
  float lr, momentum, wd;
  if (read_numbers(attributes, "sgd_momentum_rows",
                   {{"lr", &lr}, {"momentum", &momentum}, {"wd", &wd}}) != MX_SUCCESS)
    return MX_FAIL;
  float* weight = (*out)[0].data<float>();
  float* mom = (*in)[1].data<float>();
  const int64_t* index = (*in)[2].data<int64_t>();
  const float* grad = (*in)[3].data<float>();
  const int64_t width = (*in)[0].shape[1];
  for_each_row(attributes, (*in)[3].shape[0], [&](int64_t k) {
    sgd_momentum_row(weight + index[k] * width, mom + index[k] * width, grad + k * width, lr,
                     momentum, wd, width);
  });
  return MX_SUCCESS;
}

// replay_rows(weight, mom, index, coefficients): replay_row on each row `index`, with
// its 2 x 2 as (a, b, c, d) in the index's order.
MXReturnValue replay_arity(const Attributes& attributes, int* inputs, int* outputs) {
  return arity(attributes, "replay_rows", {}, 4, 1, inputs, outputs);
}

MXReturnValue replay_types(const Attributes&, std::vector<int>* in_types,
                           std::vector<int>* out_types) {
  return row_update_types("replay_rows", "coefficients", in_types, out_types);
}

MXReturnValue replay_shapes(const Attributes&, Shapes* in, Shapes* out) {
  return row_update_shapes("replay_rows", "n x 4 coefficients", 4, in, out);
}

MXReturnValue replay_forward(const Attributes& attributes, std::vector<MXTensor>* in,
                             std::vector<MXTensor>* out, const OpResource&) {
  if (rows_in_place("replay_rows", in, out) != MX_SUCCESS) return MX_FAIL;
  float* weight = (*out)[0].data<float>();
  float* mom = (*in)[1].data<float>();
  const int64_t* index = (*in)[2].data<int64_t>();
  const float* coefficients = (*in)[3].data<float>();
  const int64_t width = (*in)[0].shape[1];
  for_each_row(attributes, (*in)[3].shape[0], [&](int64_t k) {
    replay_row(weight + index[k] * width, mom + index[k] * width, coefficients + 4 * k, width);
  });
  return MX_SUCCESS;
}

}  // namespace

REGISTER_OP(pfc_replay_rows)
    .setParseAttrs(replay_arity)
    .setInferType(replay_types)
    .setInferShape(replay_shapes)
    .setMutateInputs(row_update_mutates)
    .setForward(replay_forward, "cpu");

REGISTER_OP(pfc_sgd_momentum_rows)
    .setParseAttrs(sgd_arity)
    .setInferType(sgd_types)
    .setInferShape(sgd_shapes)
    .setMutateInputs(row_update_mutates)
    .setForward(sgd_forward, "cpu");

REGISTER_OP(pfc_softmax_with_spare)
    .setParseAttrs(softmax_arity)
    .setInferType(all_float32)
    .setInferShape(softmax_shapes)
    .setForward(softmax_forward, "cpu");

REGISTER_OP(pfc_filtered_softmax_with_spare)
    .setParseAttrs(filtered_arity)
    .setInferType(filtered_types)
    .setInferShape(filtered_shapes)
    .setForward(filtered_forward, "cpu");

REGISTER_OP(pfc_subcenter_max)
    .setParseAttrs(subcenter_max_arity)
    .setInferType(all_float32)
    .setInferShape(subcenter_max_shapes)
    .setForward(subcenter_max_forward, "cpu");

REGISTER_OP(pfc_subcenter_scatter)
    .setParseAttrs(subcenter_scatter_arity)
    .setInferType(all_float32)
    .setInferShape(subcenter_scatter_shapes)
    .setForward(subcenter_scatter_forward, "cpu");

REGISTER_OP(pfc_project_rows)
    .setParseAttrs(project_arity)
    .setInferType(all_float32)
    .setInferShape(project_shapes)
    .setForward(project_forward, "cpu");

REGISTER_OP(pfc_scale_rows)
    .setParseAttrs(scale_arity)
    .setInferType(all_float32)
    .setInferShape(scale_shapes)
    .setForward(scale_forward, "cpu");

// The library's (prelu.cc's operator is in it too), once: MXNet calls it as it loads.
MXReturnValue initialize(int version) {
  // the library API of MXNet 1.9 (MX_LIBRARY_VERSION 11 in the header built against)
  return version >= 10900 ? MX_SUCCESS : MX_FAIL;
}
