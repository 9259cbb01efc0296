// CPU reference attention, computed in fp64. The oracle for every attention test: independent of
// all GPU code. Inputs are float (bf16/fp16 values are exactly representable), outputs double.
//
// Conventions (docs/CONVENTIONS.md): ragged Q [total_q, num_qo_heads, head_dim] with qo_indptr; query head
// h reads KV head h / (num_qo_heads / num_kv_heads); causal is bottom-right aligned (row i of a
// request with qo_len rows and kv_len keys sees keys j <= i + kv_len - qo_len); window_left w >= 0
// additionally requires j >= i + kv_len - qo_len - w; soft-cap applies cap * tanh(s / cap) to the
// scaled logits; LSE is the natural-log logsumexp of the (capped) scaled logits; a row with no
// visible key gives zeros and LSE = -inf.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::ref {

struct AttentionParams {
  int num_qo_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  bool causal = false;
  int window_left = -1;      // -1: no window
  double scale = 0.0;        // <= 0: 1/sqrt(head_dim)
  double soft_cap = 0.0;     // <= 0: no soft-cap

  double effective_scale() const;
};

// Is key j visible to query row i of a request with qo_len queries and kv_len keys?
bool key_visible(const AttentionParams& p, int64_t i, int64_t j, int64_t qo_len, int64_t kv_len);

// Where each request's K/V rows live. Implementations return a pointer to head_dim contiguous
// floats for (request, position, kv_head).
class KVSource {
 public:
  virtual ~KVSource() = default;
  virtual int batch_size() const = 0;
  virtual int64_t kv_len(int request) const = 0;
  virtual const float* key(int request, int64_t pos, int kv_head) const = 0;
  virtual const float* value(int request, int64_t pos, int kv_head) const = 0;
};

// Ragged (varlen) K/V: k, v are [total_kv, num_kv_heads, head_dim] row-major, request i owns rows
// [kv_indptr[i], kv_indptr[i+1]).
class RaggedKV final : public KVSource {
 public:
  RaggedKV(const float* k, const float* v, std::vector<int32_t> kv_indptr, int num_kv_heads,
           int head_dim);
  int batch_size() const override;
  int64_t kv_len(int request) const override;
  const float* key(int request, int64_t pos, int kv_head) const override;
  const float* value(int request, int64_t pos, int kv_head) const override;

 private:
  const float* k_;
  const float* v_;
  std::vector<int32_t> indptr_;
  int num_kv_heads_, head_dim_;
};

enum class PageLayout { kNHD, kHND };

// Paged K/V: pages are 4-D with the given element strides (head_dim stride is 1):
//   NHD [num_pages, page_size, num_kv_heads, head_dim], HND [num_pages, num_kv_heads, page_size,
//   head_dim]; page table kv_indptr (B+1), kv_indices, kv_last_page_len (B).
class PagedKV final : public KVSource {
 public:
  PagedKV(const float* k_pages, const float* v_pages, PageLayout layout, int page_size,
          int num_kv_heads, int head_dim, const int64_t k_strides[3], const int64_t v_strides[3],
          std::vector<int32_t> kv_indptr, std::vector<int32_t> kv_indices,
          std::vector<int32_t> kv_last_page_len);
  int batch_size() const override;
  int64_t kv_len(int request) const override;
  const float* key(int request, int64_t pos, int kv_head) const override;
  const float* value(int request, int64_t pos, int kv_head) const override;

 private:
  const float* locate(const float* base, const int64_t* strides, int request, int64_t pos,
                      int kv_head) const;
  const float* k_;
  const float* v_;
  PageLayout layout_;
  int page_size_, num_kv_heads_, head_dim_;
  int64_t k_strides_[3], v_strides_[3];  // strides of dims 0..2 (page, then the two middle dims)
  std::vector<int32_t> indptr_, indices_, last_page_len_;
};

// out: [total_q, num_qo_heads, head_dim]; lse: [total_q, num_qo_heads]. Both resized here.
void attention(const float* q, const std::vector<int32_t>& qo_indptr, const KVSource& kv,
               const AttentionParams& params, std::vector<double>& out, std::vector<double>& lse);

// Rounds x to `mantissa_bits` explicit mantissa bits, round-to-nearest-even (7: bf16, 10: fp16).
// Only the mantissa is emulated: the fp32 exponent range is kept (exact for bf16; for fp16 it
// ignores overflow above 65504 and the coarser subnormals). NaN and inf pass through.
float round_to_mantissa(float x, int mantissa_bits);

// The same computation done naively in a low precision, the way an unfused GPU implementation
// would: scores in fp32 from the (already rounded) inputs, softmax in fp32, probabilities rounded to
// `bits` mantissa bits (7 for bf16, 10 for fp16), P.V accumulated in fp32, output rounded to the
// same precision. Its error against attention() sets the tolerance of the kernels (docs/CONVENTIONS.md).
void attention_naive_lowp(const float* q, const std::vector<int32_t>& qo_indptr,
                          const KVSource& kv, const AttentionParams& params, int mantissa_bits,
                          std::vector<double>& out, std::vector<double>& lse);

}  // namespace tessera::ref
