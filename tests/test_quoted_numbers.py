"""Every result the README, figures/README.md and docs/ quote matches the committed data at its
printed precision (analyses/tools/quoted.py), and the data blocks equal their rendering from data.
The check is shown to fail: a changed digit in a copy of a page is caught."""

import re
from pathlib import Path

import numpy as np
import pytest

from analyses.tools import quoted
from analyses.tools.quoted_data import render

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def src():
    return quoted.sources()


def _readme() -> str:
    return (ROOT / "figures" / "README.md").read_text()


def test_every_quoted_result_has_a_source(src):
    bad = quoted.unsourced(src=src)
    assert not bad, "quoted results that match no data:\n" + "\n".join(
        f"{q.page}:{q.line}: {q.kind} '{q.text}'" for q in bad)


def test_the_pages_quote_results_of_every_kind():
    found = [q for p in quoted.pages() for q in quoted.quotes(p.read_text(), p.name)]
    kinds = {k: sum(q.kind == k for q in found) for k in ("interval", "range", "p", "spread", "value")}
    assert kinds["interval"] > 200 and kinds["value"] > 100 and all(kinds.values()), kinds


def test_a_changed_digit_in_a_copy_of_a_page_fails(src):
    text = _readme()
    good = "| +0.3 [−4.8, +5.4], p 0.94 |"  # Figure 3: DFPO Min-Replace − GSPO, held-out
    assert good in text
    assert not quoted.unsourced(src=src, texts={"figures/README.md": text})
    for bad in ("| +0.4 [−4.8, +5.4], p 0.94 |", "| +0.3 [−4.8, +5.5], p 0.94 |",
                "| +0.3 [−4.8, +5.4], p 0.84 |"):
        miss = quoted.unsourced(src=src, texts={"copy": text.replace(good, bad, 1)})
        assert [q.text for q in miss] == [bad.strip("| ")], bad
    # a table value beside an interval: GSPO's tax share on arithmetic independent groups
    row = re.search(r"^\| arithmetic \| independent \| 45\.5 .*\| 0\.0023 \|$", text, re.M).group(0)
    miss = quoted.unsourced(src=src, texts={"copy": text.replace(row, row.replace("0.0023", "0.0033"))})
    assert [(q.kind, q.text) for q in miss] == [("value", "0.0033")]


def test_most_single_digit_changes_are_caught(src):
    """Bump the last digit of one number of each interval of figures/README.md: the check
    catches ≥ 90 % (the rest land on another record or on a rounding tie, x.x5)."""
    found = [q for q in quoted.quotes(_readme()) if q.kind == "interval"]
    caught = total = 0
    for q in found:
        for i in range(3):
            nums = list(q.numbers)
            d = max(j for j, ch in enumerate(nums[i]) if ch.isdigit())
            nums[i] = nums[i][:d] + str((int(nums[i][d]) + 1) % 10) + nums[i][d + 1:]
            total += 1
            caught += not quoted.origins(quoted.Quote("", 0, q.kind, "", tuple(nums)), src)
    assert total > 500 and caught / total >= 0.9, (caught, total)


def test_printed_precision_and_minus_signs():
    v = np.array([0.298022, -4.843524, 0.0625, 2.6746e-8])
    assert quoted.near("+0.3", v)[0] and quoted.near("−4.8", v)[1] and quoted.near("-4.8", v)[1]
    assert not quoted.near("+0.4", v)[0] and not quoted.near("4.8", v)[1]
    assert quoted.near("0.062", v)[2] and quoted.near("0.063", v)[2]  # a tie prints either way
    assert quoted.near("2.7e-8", v)[3] and not quoted.near("2.6e-8", v)[3]


def test_settings_and_sizes_are_not_results():
    text = ("5 seeds × 150 rollout steps × 8 prompts × G = 8, lr 2e-4, 4 minibatches, 95 % "
            "intervals, [`--seeds`, 5]\n```\n+9.9 [+1.0, +2.0]\n```")
    assert quoted.quotes(text) == []
    got = quoted.quotes("x +1.5 [+0.3, +2.6], p 0.022 and [−2.1, +13.6]; p 0.5; 0.209 ± 0.005")
    assert [(q.kind, q.numbers) for q in got] == [
        ("interval", ("+1.5", "+0.3", "+2.6", "0.022")), ("range", ("−2.1", "+13.6")),
        ("p", ("0.5",)), ("spread", ("0.209", "0.005"))]


def test_data_blocks_equal_their_rendering_from_data():
    figures = ROOT / "figures"
    blocks = 0
    for page in quoted.pages():
        text = page.read_text()
        blocks += text.count("<!-- data:")
        assert render(text, figures) == text, f"{page}: run python -m analyses.tools.quoted --write"
    assert blocks >= 4
    stale = "<!-- data:gspo-tax:figure3 -->0.99 %<!-- /data -->"
    assert render(stale, figures) == "<!-- data:gspo-tax:figure3 -->1.28 %<!-- /data -->"
    with pytest.raises(ValueError, match="data block 'gspo-taxx:figure3': unknown kind"):
        render("<!-- data:gspo-taxx:figure3 -->1<!-- /data -->", figures)


def test_json_intervals_in_every_stored_form():
    """[m, lo, hi] lists, {x, x_lo, x_hi} and paired_interval's {mean, lo, hi, p} are records;
    a dict missing one bound is not."""
    from analyses.tools.quoted import _json_records

    doc = {"a": [0.5, 0.4, 0.6], "b": {"acc": 0.7, "acc_lo": 0.6, "acc_hi": 0.8},
           "c": {"paired": {"mean": -0.0143, "lo": -0.0188, "hi": -0.0098, "p": 0.0625, "n": 5}},
           "d": {"mean": 1.0, "lo": 0.5}}
    got = {tuple(r[:3]) for r in _json_records(doc).tolist()}
    assert got == {(0.5, 0.4, 0.6), (0.7, 0.6, 0.8), (-0.0143, -0.0188, -0.0098)}
    assert 0.0625 in _json_records(doc)[:, 3]  # the p-value rides along
