"""What the pages say, at the level of their text: a halted rank's message cut at a word, the
padding mass with the bound it is judged against (when the report carries it), counts with
their plurals; then the same on the pages the server renders."""

from __future__ import annotations

from fastapi.testclient import TestClient

from guard_server.page.views import WHY_SHOWN, cut, padding_mass_text, plural
from tests.server.conftest import MakeBatch


def test_a_long_message_is_cut_at_a_word_never_inside_a_number() -> None:
    text = "x" * (WHY_SHOWN - 10) + " vocab 1000. Check the tokenizer."
    assert text[:WHY_SHOWN].endswith("vocab 100")  # where a cut by characters lands
    shown = cut(text, WHY_SHOWN)
    assert shown.endswith(" vocab [...]") and "100 " not in shown
    assert cut("short message", WHY_SHOWN) == "short message"
    assert cut("a" * 700, 600) == "a" * 600 + " [...]"  # no space to cut at
    assert cut("one two three", 7) == "one two [...]"  # the cut falls on the space itself


def test_the_padding_mass_is_shown_with_its_bound() -> None:
    assert padding_mass_text(1.2e-09, 4e-08, 0.00927) == "1.2e-09 (max 4e-08; bound 0.00927)"
    assert padding_mass_text(0.9, 0.99, 0.00927) == "0.9 (max 0.99; over the bound 0.00927)"
    # No bound on the wire (an older guard, the check off): not shown.
    assert padding_mass_text(1.2e-09, 4e-08, None) == "1.2e-09 (max 4e-08)"
    assert padding_mass_text(None, None, 0.00927) == "not measured"


def test_plurals() -> None:
    assert [plural(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]


def test_the_pages_say_1_rank_cut_a_long_message_at_a_word_and_show_the_bound(
        client: TestClient, make_batch: MakeBatch) -> None:
    message = ("token_range on rank 0 at step 3: " + "ids in a long explanation " * 22
               + "against vocab 1000. Check the tokenizer / data pipeline against vocab 1000.")
    event = {"check": "token_range", "action": "fail", "step": 3, "message": message,
             "module": None}
    batch = make_batch("one", 0, steps=(1, 2, 3), halted="token_range", events=[event],
                       padding_mass=0.5, padding_mass_max=0.9)
    assert client.post("/v1/reports", json=batch).status_code == 202
    # An older guard: no bound on the wire.
    older = make_batch("older", 0)
    del older["reports"][0]["padding_mass_bound"]
    assert client.post("/v1/reports", json=older).status_code == 202
    runs = client.get("/").text
    assert "<title>logitguard: 2 runs, 1 halted rank</title>" in runs
    assert "1 rank (0 finished)" in runs and "1 ranks" not in runs
    for html in (runs, client.get("/runs/one").text):
        why = html[html.index('class="why"><bdi>'):]
        why = why[len('class="why"><bdi>'):why.index("</bdi>")]
        assert why.endswith(" [...]") and len(why) <= WHY_SHOWN + 6
        assert message.startswith(why[:-len(" [...]")] + " ")  # whole words only
        assert "0.5 (max 0.9; over the bound 0.00927)" in html
    assert "(max 4e-08)<" in client.get("/runs/older").text  # no bound, none shown
