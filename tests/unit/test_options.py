"""Widget validation (make_options) and the skip_blocks notation: pure parsing, no ComfyUI."""

import pytest

from toma_pack.nodes.options import (
    DEFAULT_SKIP_BLOCKS,
    MAX_BLOCK_INDEX,
    SkipBlocks,
    ToMAOptions,
    make_options,
    parse_skip_blocks,
)
from toma_pack.nodes.toma_node import TOMA_ADVANCED


# skip_blocks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, double, single", [
    ("d0-4, s0-4", range(5), range(5)),
    ("d0-d4,s0-s4", range(5), range(5)),
    ("d3", [3], []),
    ("s7", [], [7]),
    ("d1 d3  s2", [1, 3], [2]),
    ("D2 - 5, S0", [2, 3, 4, 5], [0]),      # case and spaces around the dash are forgiven
    ("d0-4, d2-6", range(7), []),           # overlapping ranges merge
    ("d18-18", [18], []),
    ("", [], []),
    ("none", [], []),
    ("  None  ", [], []),
])
def test_parse_skip_blocks(text, double, single):
    parsed = parse_skip_blocks(text)
    assert parsed == SkipBlocks(frozenset(double), frozenset(single))


def test_s_with_space_before_number_is_rejected():
    # "S 0" reads as two parts "s" and "0" after splitting on spaces: both unreadable
    with pytest.raises(ValueError, match="cannot read 's'"):
        parse_skip_blocks("s 0")


@pytest.mark.parametrize("text, fragment", [
    ("x3", "cannot read 'x3'"),
    ("d", "cannot read 'd'"),
    ("3-d4", "cannot read '3-d4'"),
    ("d1-s4", "cannot read 'd1-s4'"),
    ("d-3", "cannot read 'd-3'"),
    ("d1.5", "cannot read 'd1.5'"),
    ("d-1", "cannot read 'd-1'"),
    ("d5-2", "range 'd5-2' runs backwards"),
])
def test_parse_skip_blocks_errors_name_the_widget(text, fragment):
    with pytest.raises(ValueError) as err:
        parse_skip_blocks(text)
    assert str(err.value).startswith("skip_blocks: ")
    assert fragment in str(err.value)


@pytest.mark.parametrize("text, index", [
    ("d0-99999999999", "d99999999999"),    # would expand into a set of 10^11 indices
    ("s5-1000", "s1000"),
    ("d" + "9" * 5000, "d" + "9" * 5000),  # past int()'s 4300-digit limit: never converted
    ("d0-0001000", "d0001000"),
])
def test_block_indices_are_bounded_before_a_range_expands(text, index):
    with pytest.raises(ValueError) as err:
        parse_skip_blocks(text)
    assert str(err.value) == (f"skip_blocks: {index} is past every model's depth; block indices "
                              f"go up to {index[0]}{MAX_BLOCK_INDEX}")


def test_largest_block_index_is_accepted():
    assert parse_skip_blocks(f"s0-{MAX_BLOCK_INDEX}").single == frozenset(
        range(MAX_BLOCK_INDEX + 1))
    with pytest.raises(ValueError, match="^skip_blocks: d99999999999 is past every model"):
        make_options(skip_blocks="d0-99999999999")


def test_for_kinds_accepts_the_last_block_and_names_the_first_past_it():
    skip = parse_skip_blocks("d0-18, s0-37")
    skip.for_kinds([("d", 19), ("s", 38)])         # Flux.1: d0-d18, s0-s37 all exist
    with pytest.raises(ValueError) as err:
        parse_skip_blocks("d2, d19-20").for_kinds([("d", 19), ("s", 38)])
    assert "skip_blocks: d19 is past this model's depth (19 double blocks, d0-d18)" == str(
        err.value)
    with pytest.raises(ValueError, match=r"s40 is past .* \(38 single blocks, s0-s37\)"):
        parse_skip_blocks("s40").for_kinds([("d", 19), ("s", 38)])


def test_for_kinds_on_a_small_model():
    with pytest.raises(ValueError, match=r"d2 is past this model's depth \(2 double blocks"):
        parse_skip_blocks(DEFAULT_SKIP_BLOCKS).for_kinds([("d", 2), ("s", 3)])


# make_options -------------------------------------------------------------------------------------
def test_defaults():
    o = make_options()
    assert o == ToMAOptions()
    assert o.skip_blocks == SkipBlocks(frozenset(range(5)), frozenset(range(5)))
    assert (o.ratio, o.tile_count, o.merge_scope) == (0.5, 0, "auto")
    assert make_options(**TOMA_ADVANCED.defaults()) == o     # the widgets' defaults agree


def test_values_are_normalised():
    o = make_options(ratio=1 - 0.25, tile_count=256, skip_blocks="none", recompute_every=3,
                     merge_scope="attention", verbose=1)
    assert o.ratio == 0.75 and isinstance(o.ratio, float)
    assert o.skip_blocks == SkipBlocks(frozenset(), frozenset())
    assert (o.tile_count, o.recompute_every, o.merge_scope, o.verbose) == (256, 3, "attention",
                                                                           True)


@pytest.mark.parametrize("kwargs, widget", [
    ({"ratio": -0.1}, "ratio"),
    ({"ratio": 0.95}, "ratio"),
    ({"ratio": float("nan")}, "ratio"),
    ({"ratio": "0.5"}, "ratio"),
    ({"ratio": True}, "ratio"),
    ({"tile_count": -1}, "tile_count"),
    ({"tile_count": 4097}, "tile_count"),
    ({"tile_count": 64.0}, "tile_count"),
    ({"recompute_every": 0}, "recompute_every"),
    ({"start_percent": 1.5}, "start_percent"),
    ({"end_percent": -0.5}, "end_percent"),
    ({"start_percent": 0.6, "end_percent": 0.4}, "start_percent"),
    ({"start_percent": 0.5, "end_percent": 0.5}, "start_percent"),
    ({"tau": 0.5}, "tau"),
    ({"unet_levels": "some"}, "unet_levels"),
    ({"merge_scope": "model"}, "merge_scope"),
    ({"region": "circle"}, "region"),
    ({"unmerge": "inverse"}, "unmerge"),
    ({"batch_policy": "mean"}, "batch_policy"),
    ({"skip_blocks": None}, "skip_blocks"),
    ({"skip_blocks": "q1"}, "skip_blocks"),
])
def test_make_options_errors_name_the_widget(kwargs, widget):
    with pytest.raises(ValueError) as err:
        make_options(**kwargs)
    assert str(err.value).startswith(widget), str(err.value)


def test_choice_error_lists_the_choices():
    with pytest.raises(ValueError, match="merge_scope must be one of auto, block, attention; "
                                         "got 'model'"):
        make_options(merge_scope="model")


# skip_blocks on models with one kind of block ----------------------------------------------------
def test_bare_indices_name_the_blocks_of_one_kind_models():
    skip = parse_skip_blocks("0-2, 7")
    assert skip.plain == {0, 1, 2, 7} and not skip.double and not skip.single
    assert skip.for_kinds([("", 10)]) == [{0, 1, 2, 7}]
    # d and s name the same blocks there: the default leaves blocks 0-4 alone
    assert parse_skip_blocks(DEFAULT_SKIP_BLOCKS).for_kinds([("", 30)]) == [set(range(5))]
    assert parse_skip_blocks("d0-4, s0-4").for_kinds([("d", 19), ("s", 38)]) == [
        set(range(5)), set(range(5))]


def test_one_kind_notation_errors():
    with pytest.raises(ValueError, match=r"skip_blocks: 5 is past this model's depth "
                                         r"\(5 blocks, 0-4\)"):
        parse_skip_blocks("0-7").for_kinds([("", 5)])
    with pytest.raises(ValueError, match="this model has double and single blocks"):
        parse_skip_blocks("0-4").for_kinds([("d", 19), ("s", 38)])


def test_a_kind_with_no_blocks_is_no_kind():
    """HunyuanVideo 1.5 as ComfyUI builds it: 54 double blocks, 0 single blocks. The default
    leaves double blocks 0-4 alone (it used to raise "s0 is past this model's depth (0 single
    blocks, s0-s-1)"), and messages name the one kind it has."""
    hv15 = [("d", 54), ("s", 0)]
    assert parse_skip_blocks(DEFAULT_SKIP_BLOCKS).for_kinds(hv15) == [set(range(5)), set()]
    assert parse_skip_blocks("0-2").for_kinds(hv15) == [{0, 1, 2}, set()]
    assert parse_skip_blocks("none").for_kinds(hv15) == [set(), set()]
    with pytest.raises(ValueError, match=r"skip_blocks: 60 is past this model's depth "
                                         r"\(54 blocks, 0-53\)"):
        parse_skip_blocks("s60").for_kinds(hv15)
