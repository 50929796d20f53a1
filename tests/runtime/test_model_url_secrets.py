"""The secrets a model base URL carries never reach a log, an operator or a repr, in any form a server may repeat them."""

from __future__ import annotations

import logging

import pytest
import trio
from fake_model import ErrorReply, FakeModel

from persistence.transcript import Message
from runtime.config import Config, ConfigError
from runtime.models import ChatRequest, ModelConfig, ModelRejected, open_model_client, without_credentials

DEADLINE_S = 10.0
ASK = ChatRequest([Message(role="user", text="Which service holds the vault lease?")])


async def test_a_key_in_the_base_urls_query_is_scrubbed_from_what_the_server_says(
    fake_model: FakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    # Some APIs take their key in the query (Azure's api-key, Google's key): it is sent with
    # every request, `check` and the repr hide it, and a server that refuses it may say it back.
    url = fake_model.base_url + "?api-key=q-SECRET-42"
    fake_model.script = [ErrorReply(401, body="api-key q-SECRET-42 is not valid for this deployment")]
    with trio.fail_after(DEADLINE_S):
        async with open_model_client(ModelConfig(base_url=url, max_retries=0)) as client:
            with pytest.raises(ModelRejected) as refused, caplog.at_level(logging.DEBUG):
                await client.complete(ASK)
    assert "q-SECRET-42" not in without_credentials(url)  # shown to an operator without it
    assert "is not valid for this deployment" in refused.value.detail  # kept for the log...
    assert "q-SECRET-42" not in refused.value.detail  # ...without the key


@pytest.mark.parametrize(
    "url",
    ["https://bob:Zm9v/YmFy+cXV4@gateway.example/v1", "https://Zm9v/YmFy+cXV4@gateway.example/v1"],
    ids=["a password", "a key as the user name"],
)
def test_credentials_holding_a_slash_are_never_shown(url: str) -> None:
    # A base64 key holds '/' and '+'; written into the URL without percent-encoding, the URL
    # still parses (its "host" is the user name, or the password its "port"), and what follows
    # the '/' is its "path".
    assert "YmFy" not in without_credentials(url), without_credentials(url)
    try:
        config = ModelConfig(base_url=url)
    except ValueError as refused:
        assert "YmFy" not in str(refused)
    else:
        assert "YmFy" not in repr(config), repr(config)
        assert "YmFy" not in config.endpoint, config.endpoint  # what a retry's log line names
    try:
        loaded = Config.load({"AGENT_MODEL_BASE_URL": url})
    except ConfigError as problems:
        assert "YmFy" not in str(problems), str(problems)
    else:  # what `check` prints
        assert "YmFy" not in without_credentials(loaded.model_base_url)


def test_a_percent_encoded_query_key_is_scrubbed_as_written_and_decoded() -> None:
    config = ModelConfig(base_url="https://models.example/v1?api-version=1&key=q%2FSECRET%2B42")
    said = config.scrub("HTTP 401: key q/SECRET+42 (sent as q%2FSECRET%2B42) refused for api-version 1")
    assert "SECRET" not in said and said.startswith("HTTP 401: key "), said
