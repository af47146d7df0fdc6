"""How an object-patched block's calls are bound by name (dit_patch.Parameters): the same
arguments inspect.Signature.bind would find, without it (dynamo cannot trace it), and calls
handed back in the form they came."""

from __future__ import annotations

import inspect

from toma_pack.nodes.dit_patch import Parameters


def block(x, mask, freqs=None, *, options=None):
    return x, mask, freqs, options


def loose(x, **kwargs):
    return x, kwargs


def only_positional(x, /, y):
    return x, y


def starred(x, *rest):
    return x, rest


def test_binds_what_inspect_binds() -> None:
    params = Parameters.of(block)
    for args, kwargs in (((1, 2), {}), ((1,), {"mask": 2, "freqs": 3}), ((), {"x": 1, "mask": 2}),
                         ((1, 2, 3), {"options": 4})):
        assert params.bind(args, kwargs) == dict(
            inspect.signature(block).bind(*args, **kwargs).arguments)
    assert Parameters.of(loose).bind((1,), {"e": 2, "c": 3}) == {"x": 1, "e": 2, "c": 3}


def test_calls_it_cannot_take_are_not_bound() -> None:
    params = Parameters.of(block)
    assert params.bind((1, 2, 3, 4), {}) is None              # too many by position
    assert params.bind((1,), {"x": 2}) is None                 # x twice
    assert params.bind((1, 2), {"other": 3}) is None           # no such parameter
    assert Parameters.of(only_positional).bind((1, 2), {}) is None
    assert Parameters.of(starred).bind((1,), {}) is None


def test_hands_calls_back_in_their_form() -> None:
    params = Parameters.of(block)
    named = params.bind((1,), {"mask": 2, "options": 4})
    args, kwargs = params.call(1, {**named, "x": 10})
    assert (args, kwargs) == ((10,), {"mask": 2, "options": 4})
    assert block(*args, **kwargs) == (10, 2, None, 4)
