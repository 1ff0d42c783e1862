"""kernels.validate.per_signature: a check runs once per signature of its arguments and its result
is kept, a failing check raises on every call, and any change of shape, dtype, device or other
argument checks again. The routes' rule on the device (``routes_invalid``) says what the host's
(``raise_for_routes``) does."""

import pytest
import torch

from kernels.validate import check_tensor, per_signature, raise_for_routes, route_stats, routes_invalid


def test_a_check_runs_once_per_signature_and_raises_every_time():
    calls = []

    @per_signature
    def check(x, width):
        calls.append(width)
        check_tensor("x", x, dtype=torch.float32, shape=(None, width))
        return x.shape[1] * 2

    assert check(torch.zeros(3, 4), 4) == 8
    assert check(torch.ones(3, 4), 4) == 8  # new values, the same signature: kept
    assert calls == [4]
    for _ in range(2):  # not kept: it raised
        with pytest.raises(TypeError, match="x: expected dtype torch.float32"):
            check(torch.zeros(3, 4, dtype=torch.bfloat16), 4)
    assert calls == [4, 4, 4]
    with pytest.raises(ValueError, match=r"x: expected shape \('\*', 5\), got \(3, 4\)"):
        check(torch.zeros(3, 4), 5)
    assert check(torch.zeros(5, 4), 4) == 8 and calls == [4, 4, 4, 5, 4]  # another shape checks again


def test_arguments_of_equal_value_and_other_types_are_other_signatures():
    calls = []

    @per_signature
    def check(flag):
        calls.append(flag)
        if type(flag) is not int:
            raise TypeError(f"flag: expected an int, got {flag!r}")

    check(1)
    with pytest.raises(TypeError, match="flag: expected an int, got True"):
        check(True)  # True == 1, but another signature
    assert calls == [1, True]


@pytest.mark.parametrize("routes,bad", [([[0, 3], [2, -1]], False), ([[-1, -1], [-1, -1]], False),
                                        ([[0, 4], [1, 2]], True), ([[-2, 0], [1, 2]], True),
                                        ([[1, 1], [0, 2]], True), ([[-1, -1], [3, 3]], True)],
                         ids=["valid", "all-masked", "past-the-last", "below-minus-one", "repeated", "masked-repeats"])
def test_the_devices_rule_on_routes_is_the_hosts(routes, bad):
    idx_TK = torch.tensor(routes)
    stats = route_stats(idx_TK)
    assert bool(routes_invalid(stats, num_experts=4)) == bad
    if bad:
        with pytest.raises(ValueError, match="topk_idx_TK: expected"):
            raise_for_routes(idx_TK, stats.tolist(), num_experts=4)
    else:
        raise_for_routes(idx_TK, stats.tolist(), num_experts=4)
