"""Global loads and stores with PTX cache qualifiers, as device functions for a TileLang kernel
(``T.import_source`` of the source, ``T.call_extern`` of the name): TileLang emits plain moves.

``keep_in_l2`` gives the load an L2 eviction policy of ``evict_last`` (``createpolicy``; the policy
is a constant, so nvcc folds it into the load's descriptor), as torch.compile's Triton kernels load
a transpose's tiles and cast_back's scales. On an H100, with the L2 flushed before each call, that
alone took the few-row transpose from 2.24 to 2.11 us of GPU time and cast_back's scales from 117.0
to 116.0 us at 16384 x 7168, but slowed the small FP8 reduce's row gather (6.3 against 5.1 us):
measure it per kernel (``docs/design/quant.md``).

The loads' ``asm`` is not volatile (nvcc schedules them as its own loads), the stores' is: the
transpose, cast_back and mHC pre-apply compile to the same SASS as the builds measured with them.
"""

# bytes -> (PTX type, register type, asm constraint, stored type)
_TYPES = {
    1: ("u8", "unsigned", "r", "unsigned char"),
    2: ("u16", "unsigned short", "h", "unsigned short"),
    4: ("u32", "unsigned", "r", "unsigned"),
    8: ("u64", "unsigned long long", "l", "unsigned long long"),
    16: ("v4.u32", "uint4", "r", "uint4"),
}


def _operands(nbytes: int, first: int, direction: str) -> tuple[str, str]:
    """``(value, constraints)``: the asm operands of a value of ``nbytes`` (four registers for 16)
    numbered from ``first``, and their constraints (``direction`` ``"="`` for outputs, ``""`` inputs)."""
    constraint = _TYPES[nbytes][2]
    if nbytes == 16:
        return ("{" + ", ".join(f"%{first + i}" for i in range(4)) + "}",
                ", ".join(f'"{direction}r"(v.{f})' for f in "xyzw"))
    return f"%{first}", f'"{direction}{constraint}"(v)'


def _check(nbytes: int) -> None:
    if nbytes not in _TYPES:
        raise ValueError(f"nbytes: expected 1, 2, 4, 8 or 16, got {nbytes}")


def hinted_load(nbytes: int, qualifiers: str = "", keep_in_l2: bool = False) -> tuple[str, str]:
    """``(name, source)`` of ``void name(void* dst, const void* src)`` loading ``nbytes`` (1, 2, 4, 8
    or 16) from global ``src`` by ``ld.global<qualifiers>`` into ``dst`` (a local or shared address,
    aligned to ``nbytes``), of ``name_value(src)`` returning the value (an unsigned integer of
    ``nbytes``; ``uint4`` for 16) and of ``name_at(base, index)`` returning element ``index`` of an
    array of such values. Inside ``T.Parallel``, pass ``name_at`` a buffer's ``.data`` and a flat
    index: TileLang may move a guarded ``BufferLoad`` into a local copy first, and then the
    ``T.address_of`` of it is a local address (a ragged cast_back tile does)."""
    _check(nbytes)
    ptx, reg, _, stored = _TYPES[nbytes]
    value, outputs = _operands(nbytes, 0, "=")  # then the address and the policy
    n_out = 4 if nbytes == 16 else 1
    address, policy = f"%{n_out}", f"%{n_out + 1}"
    name = f"ep_load{nbytes}" + "".join(ch if ch.isalnum() else "_" for ch in qualifiers) + ("_keep_l2" if keep_in_l2 else "")
    if keep_in_l2:
        body = f"""  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm("ld.global{qualifiers}.L2::cache_hint.{ptx} {value}, [{address}], {policy};" : {outputs} : "l"(src), "l"(policy));"""
    else:
        body = f"""  asm("ld.global{qualifiers}.{ptx} {value}, [{address}];" : {outputs} : "l"(src));"""
    source = f"""
__device__ __forceinline__ {stored} {name}_value(const void* src) {{
  {reg} v;
{body}
  return static_cast<{stored}>(v);
}}
__device__ __forceinline__ void {name}(void* dst, const void* src) {{
  *reinterpret_cast<{stored}*>(dst) = {name}_value(src);
}}
__device__ __forceinline__ {stored} {name}_at(const void* base, long long index) {{
  return {name}_value(static_cast<const {stored}*>(base) + index);
}}
"""
    return name, source


def hinted_store(nbytes: int, qualifiers: str = "") -> tuple[str, str]:
    """``(name, source)`` of ``void name(void* dst, const void* src)`` storing ``nbytes`` (1, 2, 4,
    8 or 16) from ``src`` (a local or shared address) to global ``dst`` by ``st.global<qualifiers>``."""
    _check(nbytes)
    ptx, reg, _, stored = _TYPES[nbytes]
    value, inputs = _operands(nbytes, 1, "")  # after the address
    name = f"ep_store{nbytes}" + "".join(ch if ch.isalnum() else "_" for ch in qualifiers)
    source = f"""
__device__ __forceinline__ void {name}(void* dst, const void* src) {{
  {reg} v = *reinterpret_cast<const {stored}*>(src);
  asm volatile("st.global{qualifiers}.{ptx} [%0], {value};" :: "l"(dst), {inputs} : "memory");
}}
"""
    return name, source
