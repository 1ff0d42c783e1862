"""The hinted-move source generators: names and PTX per width, and a clear error for a width they lack."""

import pytest

from kernels.cache_hints import hinted_load, hinted_store


@pytest.mark.parametrize("nbytes, ptx", [(1, "u8"), (2, "u16"), (4, "u32"), (8, "u64"), (16, "v4.u32")])
def test_each_width_loads_its_type(nbytes, ptx):
    name, source = hinted_load(nbytes, ".L1::evict_last", keep_in_l2=True)
    assert f"void {name}(void* dst, const void* src)" in source
    assert f" {name}_value(const void* src)" in source and f" {name}_at(const void* base, long long index)" in source
    assert f"ld.global.L1::evict_last.L2::cache_hint.{ptx} " in source
    assert "createpolicy.fractional.L2::evict_last" in source
    plain_name, plain = hinted_load(nbytes)
    assert plain_name != name and f"ld.global.{ptx} " in plain and "createpolicy" not in plain


@pytest.mark.parametrize("nbytes, ptx, value", [(1, "u8", "%1"), (4, "u32", "%1"), (16, "v4.u32", "{%1, %2, %3, %4}")])
def test_each_width_stores_its_type(nbytes, ptx, value):
    name, source = hinted_store(nbytes, ".cs")
    assert f"void {name}(void* dst, const void* src)" in source
    assert f"st.global.cs.{ptx} [%0], {value};" in source


def test_bad_width_names_the_argument():
    for make in (hinted_load, hinted_store):
        with pytest.raises(ValueError, match="^nbytes: expected 1, 2, 4, 8 or 16, got 3"):
            make(3)
