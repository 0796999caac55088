/* moecert's C ABI: plain C functions over opaque handles and tensor
 * descriptors, for Python (ctypes) and other languages. Every function
 * returns a moecert_status; on anything but MOECERT_OK, moecert_last_error()
 * describes what went wrong on this thread. No C++ exception crosses it.
 *
 * Tensors: a moecert_tensor names memory the caller owns (data, dtype, 1 or 2
 * dimensions, strides in elements; the last dimension contiguous). An
 * optional argument or an output not asked for is the zero descriptor
 * (ndim 0). The C++ API (the headers beside this one) documents each op's maths,
 * shapes and contract clauses; this header maps onto it one to one.
 *
 * Library: libmoecert_c.so (CMake target moecert_c), which carries moecert
 * at its configured contract cap. Thread-safe: settings are process-wide
 * (scopes per thread); handles may be shared read-only between threads,
 * except a saved state, which one call at a time uses. */
#ifndef MOECERT_MOECERT_H
#define MOECERT_MOECERT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOECERT_ABI_VERSION 3

typedef enum moecert_status {
  MOECERT_OK = 0,
  MOECERT_CONTRACT_VIOLATION = 1, /* a clause failed under enforce: moecert_last_error() has it */
  MOECERT_INVALID_ARGUMENT = 2,   /* a descriptor or handle the ABI rejects before any work */
  MOECERT_OUT_OF_MEMORY = 3,
  MOECERT_INTERNAL_ERROR = 4, /* any other C++ exception, its what() in the message */
  /* A precondition failed under observe: the handler was called, the op wrote
   * no output and a training forward saved no state (a backward from it
   * fails experts.backward.state / layer.backward.state); moecert_last_error()
   * has the violation. */
  MOECERT_PRECONDITION_OBSERVED = 5
} moecert_status;

typedef enum moecert_dtype {
  MOECERT_BF16 = 0,
  MOECERT_F32 = 1,
  MOECERT_I32 = 2,
  MOECERT_F64 = 3,
  MOECERT_U8 = 4, /* quantized weight codes */
  MOECERT_I64 = 5 /* expert ids given to an op (torch.topk's): narrowed to int32 */
} moecert_dtype;

/* Contract levels, semantics and clause groups (moecert::Level, Semantic,
 * Group in contracts.hpp); a groups mask has bit i set for group i. */
typedef enum moecert_level {
  MOECERT_LEVEL_OFF = 0,
  MOECERT_LEVEL_CHECK = 1,
  MOECERT_LEVEL_AUDIT = 2,
  MOECERT_LEVEL_FULL = 3
} moecert_level;

typedef enum moecert_semantic {
  MOECERT_SEMANTIC_IGNORE = 0,
  MOECERT_SEMANTIC_OBSERVE = 1,
  MOECERT_SEMANTIC_ENFORCE = 2
} moecert_semantic;

typedef enum moecert_group {
  MOECERT_GROUP_SHAPE = 0,
  MOECERT_GROUP_INDEX = 1,
  MOECERT_GROUP_ALIAS = 2,
  MOECERT_GROUP_FINITE = 3,
  MOECERT_GROUP_NUMERIC = 4,
  MOECERT_GROUP_MEMORY = 5
} moecert_group;

/* Kernels (moecert::Isa); MOECERT_ISA_DEFAULT in an isa argument: the best
 * usable one, or MOECERT_ISA's. */
typedef enum moecert_isa {
  MOECERT_ISA_DEFAULT = -1,
  MOECERT_ISA_SCALAR = 0,
  MOECERT_ISA_AVX512_BF16 = 1,
  MOECERT_ISA_AMX_BF16 = 2,
  MOECERT_ISA_AMX_EMU = 3,
  MOECERT_ISA_AVX2 = 4
} moecert_isa;

/* Router kinds (moecert::RouterKind) and product-key weights
 * (moecert::router::KeyWeights). */
typedef enum moecert_router {
  MOECERT_ROUTER_SOFTMAX_TOPK = 0,
  MOECERT_ROUTER_SIGMOID_TOPK = 1,
  MOECERT_ROUTER_PRODUCT_KEY = 2
} moecert_router;

typedef enum moecert_key_weights {
  MOECERT_KEY_WEIGHTS_RAW = 0,
  MOECERT_KEY_WEIGHTS_EXP = 1,
  MOECERT_KEY_WEIGHTS_SOFTMAX = 2
} moecert_key_weights;

/* Weight formats (moecert::WeightFormat, moecert/formats.hpp). */
typedef enum moecert_weight_format {
  MOECERT_FORMAT_BF16 = 0,
  MOECERT_FORMAT_INT8_CHANNEL = 1,
  MOECERT_FORMAT_INT4_GROUP = 2,
  MOECERT_FORMAT_FP8_E4M3_BLOCK128 = 3
} moecert_weight_format;

/* The enums above, for moecert_enum_name. */
typedef enum moecert_enum {
  MOECERT_ENUM_STATUS = 0,
  MOECERT_ENUM_DTYPE = 1,
  MOECERT_ENUM_LEVEL = 2,
  MOECERT_ENUM_SEMANTIC = 3,
  MOECERT_ENUM_GROUP = 4,
  MOECERT_ENUM_ISA = 5,
  MOECERT_ENUM_ROUTER = 6,
  MOECERT_ENUM_KEY_WEIGHTS = 7,
  MOECERT_ENUM_WEIGHT_FORMAT = 8
} moecert_enum;

/* The name of value `value` of enum `which` (a moecert_enum) as the C++ API,
 * the reports and the Python package spell it ("softmax_topk", "audit",
 * "bf16", ...); with which = -1, the name of enum `value` ("status", "dtype",
 * "level", ...). NULL when out of range; values run from 0 without gaps. */
const char* moecert_enum_name(int32_t which, int32_t value);

typedef struct moecert_tensor {
  void* data;    /* may be NULL only when the tensor has no elements */
  int32_t dtype; /* moecert_dtype */
  int32_t ndim;  /* 0: absent; 1 or 2 */
  int64_t shape[2];
  int64_t stride[2]; /* in elements; stride[ndim - 1] == 1; 2-D: stride[0] >= shape[1] */
} moecert_tensor;

/* What the last failing call on this thread reported. Strings are never NULL
 * (empty when not applicable) and stay valid until this thread's next call
 * that fails. For MOECERT_CONTRACT_VIOLATION every field is the C++
 * moecert::Violation's; otherwise op names the ABI function and message says
 * what was wrong. */
typedef struct moecert_error {
  int32_t status;       /* moecert_status */
  const char* op;       /* e.g. "experts.backward" */
  const char* clause;   /* e.g. "experts.backward.dy_finite"; "" outside contracts */
  const char* kind;     /* "pre", "post" or "invariant" */
  const char* group;    /* "shape", "index", "alias", "finite", "numeric" or "memory" */
  const char* level;    /* the clause's level */
  const char* location; /* e.g. "dy[3, 5]" */
  const char* observed;
  const char* expected;
  const char* message; /* one line a person can act on */
  const char* file;    /* where it was detected */
  int32_t line;
} moecert_error;

const moecert_error* moecert_last_error(void);

/* ---- library ---------------------------------------------------------- */

int32_t moecert_abi_version(void);    /* MOECERT_ABI_VERSION of the library */
const char* moecert_version(void);    /* e.g. "0.1.0" */
const char* moecert_build_info(void); /* one line: build type, compiler, commit, contract cap */

/* Contract settings (contracts.hpp): level a moecert_level, semantic a
 * moecert_semantic, groups a mask of moecert_group bits. The getters give what is in effect
 * on this thread (innermost scope, level clamped to the cap); -1 (groups:
 * UINT32_MAX) when MOECERT_CONTRACTS or MOECERT_CONTRACT_GROUPS does not
 * parse, moecert_last_error() naming it (MOECERT_INVALID_ARGUMENT), as every
 * op call then reports. Malformed MOECERT_GUARD_PAGES and MOECERT_ISA are
 * reported the same way by the ops (and moecert_default_isa returns -1). */
moecert_status moecert_set_contract_level(int32_t level);
moecert_status moecert_set_contract_semantic(int32_t semantic);
moecert_status moecert_set_contract_groups(uint32_t groups);
int32_t moecert_contract_level(void);
int32_t moecert_contract_semantic(void);
uint32_t moecert_contract_groups(void);
int32_t moecert_contract_level_cap(void);
/* A per-thread override, as moecert::ContractScope, for every call this
 * thread makes until the matching pop (scopes nest). */
moecert_status moecert_contract_scope_push(int32_t level, int32_t semantic, uint32_t groups);
moecert_status moecert_contract_scope_pop(void);

/* Worker threads of every op (oneTBB's max_allowed_parallelism); 0: oneTBB's
 * default (every core of the process's affinity mask). Results do not depend
 * on it. */
moecert_status moecert_set_num_threads(int32_t threads);
int32_t moecert_num_threads(void);

/* Kernels: an isa argument is a moecert_isa. */
int32_t moecert_default_isa(void);
int32_t moecert_isa_usable(int32_t isa);
const char* moecert_isa_name(int32_t isa); /* "" if out of range */

/* ---- experts ---------------------------------------------------------- */

/* Packed expert weights (experts::PackedExperts), immutable once packed. */
typedef struct moecert_experts moecert_experts;

/* w_gate, w_up [E*I x H] bf16, w_down [E*H x I] bf16; backward != 0 also
 * packs the orientations a backward multiplies by. */
moecert_status moecert_experts_pack(int64_t experts, const moecert_tensor* w_gate,
                                    const moecert_tensor* w_up, const moecert_tensor* w_down,
                                    int32_t backward, moecert_experts** out);
void moecert_experts_free(moecert_experts* w);
/* The weights moecert_experts_pack was given, bitwise, written into w_gate,
 * w_up [E*I x H] and w_down [E*H x I] bf16 (three separate tensors). */
moecert_status moecert_experts_unpack(const moecert_experts* w, const moecert_tensor* w_gate,
                                      const moecert_tensor* w_up, const moecert_tensor* w_down);
/* One quantized matrix [rows x cols] of a moecert_weight_format other than
 * bf16 (moecert::QuantView): codes u8 [rows x row bytes] (int4: ceil(cols / 2)
 * bytes a row, element 2j in the low nibble of byte j), scales f32
 * [ceil(rows / block rows) x ceil(cols / block columns)] (moecert_format_info). */
typedef struct moecert_quant {
  moecert_tensor codes;
  moecert_tensor scales;
  int64_t cols;
} moecert_quant;

/* A format's code width in bits (16 for bf16) and scale block: rows and
 * columns of a matrix per scale (0: all). Any pointer may be NULL. */
moecert_status moecert_format_info(int32_t format, int32_t* code_bits, int64_t* block_rows,
                                   int64_t* block_cols);

/* Packs quantized expert weights: w_gate, w_up, w_down point to `experts`
 * matrices each (gate and up [I x H], down [H x I], each with its own
 * scales), all of `format`; the kernels compute with bf16(fp32(code *
 * scale)). backward as for moecert_experts_pack. */
moecert_status moecert_experts_pack_quantized(int32_t format, int64_t experts,
                                              const moecert_quant* w_gate,
                                              const moecert_quant* w_up,
                                              const moecert_quant* w_down, int32_t backward,
                                              moecert_experts** out);
/* A quantized pack's codes and scales, bitwise those it was given, written
 * into `experts` matrices each of the packed shapes. */
moecert_status moecert_experts_unpack_quantized(const moecert_experts* w,
                                                const moecert_quant* w_gate,
                                                const moecert_quant* w_up,
                                                const moecert_quant* w_down);
/* The pack's moecert_weight_format. */
moecert_status moecert_experts_format(const moecert_experts* w, int32_t* format);
/* The quantizer (moecert::quantize): w [rows x cols] f32 into codes and
 * scales of `format` (a moecert_quant of w's shape), round to nearest. */
moecert_status moecert_quantize(int32_t format, const moecert_tensor* w, const moecert_quant* out);

/* Any pointer may be NULL. */
moecert_status moecert_experts_shape(const moecert_experts* w, int64_t* experts, int64_t* hidden,
                                     int64_t* inter, int32_t* backward, int64_t* bytes);

/* LoRA factors stacked by expert (experts::Lora): a_gate, a_up [E*r x H],
 * b_gate, b_up [E*I x r], a_down [E*r x I], b_down [E*H x r], all six bf16 or
 * all six f32; scale float(alpha / rank). A NULL moecert_lora pointer, or rank
 * 0: no LoRA. f32 factors (an optimizer's master weights) are rounded to bf16
 * (nearest even, on moecert's threads) by the training forward into its saved
 * state; the backward and the bounds, given the same f32 tensors, read that
 * rounding (other tensors: MOECERT_INVALID_ARGUMENT). */
typedef struct moecert_lora {
  moecert_tensor a_gate, b_gate, a_up, b_up, a_down, b_down;
  int64_t rank;
  double alpha;
} moecert_lora;

/* What a training forward keeps for its backward (experts::Saved). */
typedef struct moecert_experts_saved moecert_experts_saved;
moecert_status moecert_experts_saved_new(moecert_experts_saved** out);
void moecert_experts_saved_free(moecert_experts_saved* s);

typedef struct moecert_train_options {
  int32_t isa;         /* -1: default */
  int32_t training;    /* keep what the backward needs */
  uint64_t memory_cap; /* bytes, 0: none */
} moecert_train_options;

/* Inference forward (experts::forward): x [T x H] bf16, idx [T x K] int32,
 * weights [T x K] f32, y [T x H] f32. Ids an op reads (here, the training
 * forward, the router backwards, moecert_router_bounds) may also be int64
 * (MOECERT_I64): narrowed to int32, a value outside int32 refused naming its
 * place (MOECERT_INVALID_ARGUMENT), as is an int64 idx sharing memory with an
 * output. Ids an op writes are int32. */
moecert_status moecert_experts_forward(const moecert_experts* w, const moecert_tensor* x,
                                       const moecert_tensor* idx, const moecert_tensor* weights,
                                       const moecert_tensor* y, int32_t isa);

/* Training forward (experts::forward_train); options NULL: defaults. */
moecert_status moecert_experts_forward_train(const moecert_experts* w, const moecert_lora* lora,
                                             const moecert_tensor* x, const moecert_tensor* idx,
                                             const moecert_tensor* weights, const moecert_tensor* y,
                                             moecert_experts_saved* saved,
                                             const moecert_train_options* options);

/* Gradients (experts::Gradients), f32, each absent or of its shape; dx may be
 * bf16 (the f32 dx rounded to nearest even on moecert's threads, as a bf16
 * input's gradient is stored). */
typedef struct moecert_experts_grads {
  moecert_tensor dx, dweights;
  moecert_tensor a_gate, b_gate, a_up, b_up, a_down, b_down;
  moecert_tensor w_gate, w_up, w_down;
  moecert_tensor m_a, m_g;
} moecert_experts_grads;

moecert_status moecert_experts_backward(const moecert_experts* w, const moecert_lora* lora,
                                        const moecert_tensor* x, const moecert_tensor* dy,
                                        moecert_experts_saved* saved,
                                        const moecert_experts_grads* grads);

/* ---- routers (router.hpp) ---------------------------------------------- */

/* z [T x E] f32 or bf16; idx [T x K] int32, w [T x K] f32 written. */
moecert_status moecert_softmax_topk_forward(const moecert_tensor* z, const moecert_tensor* idx,
                                            const moecert_tensor* w, int32_t renormalize);
/* z [T x E] f32, g = dL/dw [T x K] f32; dz [T x E] f32 written. */
moecert_status moecert_softmax_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                             const moecert_tensor* g, const moecert_tensor* dz,
                                             int32_t renormalize);
/* bias [E] f32 (selection only). */
moecert_status moecert_sigmoid_topk_forward(const moecert_tensor* z, const moecert_tensor* bias,
                                            int64_t groups, int64_t topk_group, float scaling,
                                            const moecert_tensor* idx, const moecert_tensor* w);
moecert_status moecert_sigmoid_topk_backward(const moecert_tensor* z, const moecert_tensor* idx,
                                             const moecert_tensor* g, int64_t groups,
                                             int64_t topk_group, float scaling,
                                             const moecert_tensor* dz);
/* sx, sy [T x n] f32 or bf16 (backward: f32); mode: a moecert_key_weights. */
moecert_status moecert_product_key_forward(const moecert_tensor* sx, const moecert_tensor* sy,
                                           int32_t mode, const moecert_tensor* idx,
                                           const moecert_tensor* w);
moecert_status moecert_product_key_backward(const moecert_tensor* sx, const moecert_tensor* sy,
                                            const moecert_tensor* idx, const moecert_tensor* g,
                                            int32_t mode, const moecert_tensor* dsx,
                                            const moecert_tensor* dsy);

/* ---- layer (layer.hpp) ------------------------------------------------- */

/* MoeConfig. router: a moecert_router. */
typedef struct moecert_config {
  int64_t experts, hidden, inter, topk, lora_rank;
  double lora_alpha;
  int32_t router;
  int32_t renormalize;
  int64_t groups, topk_group;
  double scaling;
  int64_t max_tokens;
} moecert_config;

moecert_status moecert_config_validate(const moecert_config* cfg);

/* The router linear's width R of a valid config: E, or 2n for product_key. */
moecert_status moecert_config_router_width(const moecert_config* cfg, int64_t* width);

/* router_w [R x H] f32, router_b [R] f32, router_bias [E] f32 (sigmoid_topk;
 * absent otherwise); R = E, or 2n for product_key. */
typedef struct moecert_layer_weights {
  const moecert_experts* experts;
  moecert_tensor router_w, router_b, router_bias;
  moecert_lora lora;
} moecert_layer_weights;

typedef struct moecert_layer_saved moecert_layer_saved;
moecert_status moecert_layer_saved_new(moecert_layer_saved** out);
void moecert_layer_saved_free(moecert_layer_saved* s);
/* The routing of the last forward: idx [T x K] int32, weights [T x K] f32
 * (each absent or written). */
moecert_status moecert_layer_saved_routing(const moecert_layer_saved* s, const moecert_tensor* idx,
                                           const moecert_tensor* weights);
/* The router's intermediates, each absent or written (f32): z [T x R] the
 * logits of the last training forward (until a backward reuses their
 * memory); dweights [T x K] (dL/dw) and dz [T x R] (product_key: [dsx | dsy])
 * of the last backward that ran the router path. One asked for and not held:
 * MOECERT_INVALID_ARGUMENT. */
moecert_status moecert_layer_saved_router(const moecert_layer_saved* s, const moecert_tensor* z,
                                          const moecert_tensor* dweights, const moecert_tensor* dz);

moecert_status moecert_layer_forward(const moecert_config* cfg, const moecert_layer_weights* w,
                                     const moecert_tensor* x, const moecert_tensor* y,
                                     moecert_layer_saved* saved,
                                     const moecert_train_options* options);

/* As moecert_experts_grads; router_b [R]. */
typedef struct moecert_layer_grads {
  moecert_tensor dx, router_w, router_b;
  moecert_tensor a_gate, b_gate, a_up, b_up, a_down, b_down;
  moecert_tensor w_gate, w_up, w_down;
  moecert_tensor m_a, m_g;
} moecert_layer_grads;

moecert_status moecert_layer_backward(const moecert_config* cfg, const moecert_layer_weights* w,
                                      const moecert_tensor* x, const moecert_tensor* dy,
                                      moecert_layer_saved* saved, const moecert_layer_grads* grads,
                                      int32_t expert_path, int32_t router_path);

/* The layer's router linear alone (layer::router_linear_forward/backward):
 * x [T x H] bf16, router_w [R x H] f32, router_b [R] f32, z [T x R] f32
 * written. Backward from dz [T x R] f32: dx [T x H] f32 accumulated
 * (dx += dz W_r), router_w grad [R x H] and router_b grad [R] written; each
 * absent or given. isa: as moecert_train_options. */
moecert_status moecert_router_linear_forward(const moecert_tensor* x,
                                             const moecert_tensor* router_w,
                                             const moecert_tensor* router_b,
                                             const moecert_tensor* z, int32_t isa);
moecert_status moecert_router_linear_backward(const moecert_tensor* x,
                                              const moecert_tensor* router_w,
                                              const moecert_tensor* dz, const moecert_tensor* dx,
                                              const moecert_tensor* d_router_w,
                                              const moecert_tensor* d_router_b, int32_t isa);

/* ---- derived bounds (contracts/) ---------------------------------------- */

/* Element-wise bounds |kernel - exact| <= bound, as the full-level
 * within_bound clauses use them (proofs/experts.md, layer.md, router.md),
 * written as f64 tensors of the outputs' shapes (each absent or written).
 * Experts and layer: for the saved forward (and, with dy, the backward that
 * ran on it, with the paths whose bounds are asked for). */
moecert_status moecert_experts_bounds(const moecert_experts* w, const moecert_lora* lora,
                                      const moecert_tensor* x, const moecert_tensor* dy,
                                      const moecert_experts_saved* saved, const moecert_tensor* y,
                                      const moecert_experts_grads* grads);
moecert_status moecert_layer_bounds(const moecert_config* cfg, const moecert_layer_weights* w,
                                    const moecert_tensor* x, const moecert_tensor* dy,
                                    const moecert_layer_saved* saved, const moecert_tensor* y,
                                    const moecert_layer_grads* grads);
/* kind: a moecert_router; param: renormalize (softmax_topk), scaling
 * (sigmoid_topk) or a moecert_key_weights (product_key; z = [sx | sy], [T x 2n]); z f32 as the kernel read it;
 * idx the kernel's selection; w_bound [T x K]; with g, dz_bound [T x E] (product_key:
 * [T x 2n], dsx then dsy). */
moecert_status moecert_router_bounds(int32_t kind, double param, const moecert_tensor* z,
                                     const moecert_tensor* idx, const moecert_tensor* g,
                                     const moecert_tensor* w_bound, const moecert_tensor* dz_bound);

/* ---- The judge (docs/JUDGE.md) ---- */

/* A tensor by name for moecert_check. stored_as: 0 the values are as their
 * dtype holds them; 1 they were stored in bf16, 2 in IEEE fp16 (and widened
 * by the caller): that storage's rounding enters the bounds. */
typedef struct moecert_named_tensor {
  const char* name;
  moecert_tensor tensor; /* 2-D: f32, bf16 or f64 values; i32 indices */
  int32_t stored_as;
} moecert_named_tensor;

/* Judges another implementation's outputs of op (the routers'
 * "router.softmax_topk.forward", ".backward" and the like, "experts.forward",
 * "experts.forward_train", "experts.backward", "layer.forward",
 * "layer.backward"; tensor names and params: docs/JUDGE.md) for the given
 * inputs with moecert's clauses at level full, tie-aware; params are
 * "name=value" strings (precision, renormalize, weights, router, ...). On MOECERT_OK, *verdict_json
 * is the verdict (schema moecert-check/1), passed or failed, to be freed with
 * moecert_free_string; an unknown op, a missing tensor or a bad parameter is
 * MOECERT_INVALID_ARGUMENT. Judgements take turns (the violation handler is
 * the process's); meanwhile a violation of another thread's op is raised as
 * usual but not printed under observe. */
moecert_status moecert_check(const char* op, const moecert_named_tensor* inputs, size_t n_inputs,
                             const moecert_named_tensor* outputs, size_t n_outputs,
                             const char* const* params, size_t n_params, char** verdict_json);
void moecert_free_string(char* s);

#ifdef __cplusplus
}
#endif

#endif /* MOECERT_MOECERT_H */
