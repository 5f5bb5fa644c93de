// FP8 attention state ("--state fp8" exports): the per-entry byte layouts of the window ring, the compressed entries
// and the indexer keys, their quantiser (the writers) and exact decoders (the readers). Spec: models/functional.py
// `fp8_entry_encode` / `fp8_index_encode` and their decoders; dsv4-architecture.md §7.2 gives the released engines'
// formats this generalises.
//
// Attention entry (window slot or compressed entry) of D channels whose last rd channels carry RoPE; D - rd must be
// a multiple of 64. One entry is EntryBytes(D, rd) bytes, stored per entry ([B, N, EntryBytes] uint8; the engines'
// paged "all data, then all scales" block layout is not used):
//   [0, D-rd)                 E4M3FN codes of the no-rope channels
//   [D-rd, D-rd + 2rd)        the rope channels as bf16 (little-endian; round-to-nearest-even from float32)
//   [D+rd, D+rd + nb)         one E8M0 scale byte per 64 no-rope channels (nb = (D-rd)/64), then zero bytes up to
//                             a multiple of 8 (D = 512, rd = 64: 448 + 128 + 7 + 1 = 584)
// Index key of cI channels: cI E4M3FN codes, then one float32 power-of-two scale (little-endian): cI + 4 bytes.
//
// Quantiser, per 64-channel block (attention) or per key (index), in float32:
//   amax = max |x| (NaN when the block holds a NaN, as torch's amax)
//   s = max(amax, 1e-4) / 448; scale = 2^e with e the smallest integer such that 2^e >= s (exact, via frexp);
//   a non-finite amax gives e = 127 (+-inf round-trips as +-inf: 448 * 2^127 overflows float32; NaN stays NaN)
//   code = E4M3FN(x / scale): round-to-nearest-even, |x / scale| >= 448 saturates to +-448, NaN -> 0x7F (sign kept)
// Decoder: value = e4m3(code) * scale (exact in float32 and in bfloat16: 4 significant bits times a power of two),
// rope channels widened from bf16. An E8M0 byte 0xFF decodes to a NaN scale, which propagates (state bytes are not
// validated: only the rows a query reads are ever decoded).
//
// Everything here is baseline ISA and declared only (no inline definitions), so files built with AVX512/AMX flags
// may call it without pulling an ISA-compiled copy into baseline callers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsv4 {
namespace state_fp8 {

constexpr int64_t kBlock = 64;          // no-rope channels per E8M0 scale
constexpr float kAmaxFloor = 1e-4f;     // amax below this uses the floor's scale

// Bytes of one attention entry; -1 when the layout does not exist (dim < 1, rope outside [0, dim], or dim - rope not
// a multiple of 64).
int64_t EntryBytes(int64_t dim, int64_t rope);
// Bytes of one index key (dim + 4); -1 when dim < 1.
int64_t IndexKeyBytes(int64_t dim);

// E4M3FN code of v (round-to-nearest-even, saturating to +-448, NaN -> 0x7F | sign).
uint8_t EncodeE4M3(float v);
// The power-of-two exponent e of the scale for a block whose largest magnitude is amax (rule above).
int ScaleExponent(float amax);

// x [dim] float32 -> out [EntryBytes(dim, rope)].
void EncodeEntry(const float* x, int64_t dim, int64_t rope, uint8_t* out);
// in [EntryBytes] -> out [dim] float32 / bf16 bits (exact).
void DecodeEntry(const uint8_t* in, int64_t dim, int64_t rope, float* out);
void DecodeEntry(const uint8_t* in, int64_t dim, int64_t rope, uint16_t* out);

// x [dim] float32 -> out [dim + 4]; and back (exact).
void EncodeIndexKey(const float* x, int64_t dim, uint8_t* out);
void DecodeIndexKey(const uint8_t* in, int64_t dim, float* out);
void DecodeIndexKey(const uint8_t* in, int64_t dim, uint16_t* out);

// Where a writer stores FP8 entries: entry i of batch row b at data + (b * capacity + i) * row_bytes. `index`
// selects the index-key layout (else the attention layout with `rope` rope channels).
struct EntryOut {
  uint8_t* data;
  int64_t row_bytes;
  int64_t rope;
  bool index;
};
// Encodes the float32 entry e [dim] into slot (b, i) of `out` (capacity = entries per batch row).
void StoreEntry(const float* e, int64_t dim, const EntryOut& out, int64_t capacity, int64_t b, int64_t i);

}  // namespace state_fp8
}  // namespace dsv4
