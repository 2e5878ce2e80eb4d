"""``scripts/bench/common.py``, what several benchmarks share: ratios and the best of present
values, table cells and Markdown tables, argument types that name the flag and the bad value,
the section writer behind every ``--write-doc`` and the JSON dump. Pure, no processes."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))

from bench import common  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_ratios_best_and_medians_leave_missing_values_out():
    assert common.ratio(3.0, 2.0) == 1.5
    assert common.ratio(None, 2.0) is None and common.ratio(1.0, 0.0) is None
    assert common.best([1.0, None, math.nan, 3.0, math.inf]) == 3.0
    assert common.best([None, math.nan]) is None
    assert common.median_of([{"a": 1.0}, {"a": None}, {"a": 3.0}], "a") == 2.0
    assert math.isnan(common.median_of([{"a": None}], "a"))


def test_cells_and_tables():
    assert common.cell("DP2: 0 L0-1 | 1 L0-1") == "DP2: 0 L0-1; 1 L0-1"
    assert common.cell(None) == "-" and common.fmt(None) == "-" and common.ms(None) == "-"
    assert common.fmt(1234.5) == "1,234" and common.ms(0.25) == "250"
    assert common.md_table(("a", "b"), [(1, "x")]) == ["| a | b |", "|---|---|", "| 1 | x |"]


@pytest.mark.parametrize("parse, text, why", [
    (common.int_flag("--steps", 1, 10), "0", "--steps=0 must be in [1, 10]"),
    (common.int_flag("--steps", 1, 10), "x", "--steps='x' is not an integer"),
    (common.seconds_flag("--dwell", 1.0, 60.0), "nan", "--dwell=nan must be in [1, 60] s"),
    (common.seconds_flag("--dwell", 1.0, 60.0), "soon", "--dwell='soon' is not a number"),
])
def test_argument_types_name_the_flag_and_the_value(parse, text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why.replace("[", r"\[")):
        parse(text)


def test_a_section_is_appended_then_replaced_and_the_others_are_kept(tmp_path):
    doc = tmp_path / "benchmarks.md"
    common.write_section(str(doc), "## Mine", "first\n")
    assert doc.read_text() == "# Benchmarks\n\n## Mine\n\nfirst\n"
    doc.write_text(doc.read_text() + "\n## Theirs\n\nkept\n")
    common.write_section(str(doc), "## Mine", "\n\nsecond\n\n")
    assert doc.read_text() == "# Benchmarks\n\n## Mine\n\nsecond\n\n## Theirs\n\nkept\n"
    assert common.with_section("## Mine\n\nold\n", "## Mine", "new") == "## Mine\n\nnew\n"


def test_the_json_dump_has_no_nan(tmp_path):
    path = tmp_path / "r.json"
    common.dump(str(path), {"a": math.nan, "b": [1.0, math.inf], "c": {"d": 2}})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2}}
