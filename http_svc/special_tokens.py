"""`add_special_tokens`, as vLLM takes it, over a scheduler that tokenizes a text prompt with
the special tokens the model's tokenizer adds (a BOS, where the model asks for one) and a
rendered chat without them (the template writes its own).

What the tokenizer adds is learned once per model by tokenizing an empty text (a BOS-adding
post-processor gives just the BOS). A text with `add_special_tokens: false` is tokenized and
sent as token ids without them; a chat with `add_special_tokens: true` gets them in front, as
vLLM's tokenizing the rendered chat with them does.
"""

from collections.abc import Sequence

from http_svc.scheduler_client import ModelCard, Prompt, SchedulerClient


class SpecialTokens:
    def __init__(self, client: SchedulerClient) -> None:
        self.client = client
        self._known: tuple[ModelCard, tuple[int, ...]] | None = None

    async def added(self) -> tuple[int, ...]:
        """The ids the tokenizer adds to every text (none for most byte-level BPEs)."""
        card = await self.client.model_card()
        if self._known is None or self._known[0] != card:
            ids, _ = await self.client.tokenize(Prompt(text=""))
            self._known = (card, tuple(ids))
        return self._known[1]

    async def text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """A text's token ids, with or without what the tokenizer adds."""
        ids, _ = await self.client.tokenize(Prompt(text=text))
        return ids if add_special_tokens else without(ids, await self.added())

    async def chat_ids(self, ids: Sequence[int], add_special_tokens: bool) -> list[int]:
        """A rendered chat's token ids, with the added ones in front if asked for."""
        return [*(await self.added()), *ids] if add_special_tokens else list(ids)


def without(ids: Sequence[int], added: Sequence[int]) -> list[int]:
    """`ids` less the added ones, in front (a BOS) or at the end (an EOS)."""
    n = len(added)
    if n and list(ids[:n]) == list(added):
        return list(ids[n:])
    if n and list(ids[-n:]) == list(added):
        return list(ids[:-n])
    return list(ids)
