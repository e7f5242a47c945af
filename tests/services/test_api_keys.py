"""Clients' API keys (services.api_keys): the flag and SPLITSERVE_API_KEY (several keys, flag
over variable), refused key values naming the key, the bearer token of a header or of gRPC
metadata, the check against every configured key (owner = the key's digest, never the key),
and why a call is refused."""

import argparse

import pytest

from services import api_keys
from services.api_keys import ApiKeys, bearer, from_metadata, key_list
from services.flags import FlagParser
from services.service_flags import add_http_flags, add_scheduler_flags


def test_a_key_list_is_comma_separated_and_trimmed() -> None:
    assert key_list("a1") == ("a1",)
    assert key_list(" a1 , b-2,c_3 ") == ("a1", "b-2", "c_3")


@pytest.mark.parametrize("text, words", [("a,,b", "API key 2 of 3 is empty"),
                                         ("", "API key 1 of 1 is empty"),
                                         ("a,b c", "API key 2 of 2 has a space"),
                                         ("ключ", "API key 1 of 1 has a space or a character")])
def test_bad_keys_are_refused_naming_which(text: str, words: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        key_list(text)


@pytest.mark.parametrize("add", [add_scheduler_flags, add_http_flags])
def test_the_flag_wins_over_the_variable_and_repeats(add) -> None:  # type: ignore[no-untyped-def]
    def keys(argv: list[str], environ: dict[str, str]) -> tuple[str, ...]:
        return tuple(add(FlagParser(environ=environ)).parse_args(argv).api_key)

    assert keys([], {}) == ()
    assert keys([], {"SPLITSERVE_API_KEY": "k1,k2"}) == ("k1", "k2")
    assert keys(["--api-key", "f1"], {"SPLITSERVE_API_KEY": "k1,k2"}) == ("f1",)
    assert keys(["--api-key", "f1", "--api-key", "f2,f3"], {}) == ("f1", "f2", "f3")


def test_a_bad_variable_is_refused_at_start_naming_it(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with pytest.raises(SystemExit):
        add_http_flags(FlagParser(environ={"SPLITSERVE_API_KEY": "a,,b"}))
    assert "SPLITSERVE_API_KEY" in capsys.readouterr().err


def test_bearer_tokens() -> None:
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer   abc ") == "abc"
    assert bearer(b"BEARER abc") == "abc"
    for value in (None, "", "Bearer", "Bearer ", "Basic abc", "abc"):
        assert bearer(value) is None
    assert from_metadata([("x-other", "1"), ("authorization", "Bearer k")]) == "k"
    assert from_metadata([("x-other", "1")]) is None and from_metadata(None) is None
    assert api_keys.call_metadata("k") == (("authorization", "Bearer k"),)
    assert api_keys.call_metadata(None) == ()


def test_every_configured_key_passes_and_nothing_else() -> None:
    keys = ApiKeys(["first-key", "second-key", "first-key"])
    assert keys and len(keys) == 2
    owners = {k: keys.check(k) for k in ("first-key", "second-key")}
    assert all(o is not None for o in owners.values())
    assert owners["first-key"] != owners["second-key"]          # one owner per key
    assert all(k not in o for k, o in owners.items())           # a digest, not the key
    for wrong in ("first-ke", "first-key2", "second-KEY", "", " first-key"):
        assert keys.check(wrong) is None
    assert keys.check(None) is None


def test_why_a_call_is_refused_never_names_the_key() -> None:
    keys = ApiKeys(["secret-key-1"])
    assert keys.refusal("secret-key-1") is None
    assert keys.refusal(None) == api_keys.MISSING and "Bearer" in api_keys.MISSING
    assert keys.refusal("guess") == api_keys.INVALID and "guess" not in api_keys.INVALID
    assert keys.owner("secret-key-1") == keys.check("secret-key-1")
    # No keys: open, nobody owns a request.
    open_ = ApiKeys()
    assert not open_ and open_.refusal(None) is None and open_.refusal("x") is None
    assert open_.owner("x") is None

