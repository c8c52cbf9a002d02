"""Tokens as the model was trained on them: the pipeline's perplexity is transformers' own loss, BOS or not."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from pruneops.data.corpus import affixes_of, hf_encode, to_blocks  # noqa: E402
from pruneops.models.language import perplexity  # noqa: E402
from tests.decoder_helpers import BOS_ID, VOCAB, speeches, tiny_decoder, tiny_tokenizer  # noqa: E402


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_the_pipelines_perplexity_is_transformers_own_loss_on_the_same_text(bos):
    tokenizer = tiny_tokenizer(bos=bos)
    model = tiny_decoder("llama", vocab_size=VOCAB + 1)
    document = speeches(1, seed=3)[0]
    ids = tokenizer(document)["input_ids"]  # what transformers feeds: the BOS where the tokenizer adds one
    assert (ids[0] == BOS_ID) is bos
    blocks, _ = to_blocks([document, *speeches(3, seed=4)], tokenizer, len(ids))
    assert blocks[0].tolist() == ids
    ours = perplexity(model, blocks[:1]).value
    with torch.inference_mode():
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert ours == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_every_block_starts_with_the_bos_and_documents_are_separated_as_the_tokenizer_says():
    tokenizer = tiny_tokenizer(bos=True)
    assert affixes_of(hf_encode(tokenizer)).prefix == (BOS_ID,)
    assert affixes_of(hf_encode(tiny_tokenizer())).prefix == ()
    documents = speeches(12, seed=5)
    blocks, tokens = to_blocks(documents, tokenizer, 16)
    assert (blocks[:, 0] == BOS_ID).all()
    eos = tokenizer.eos_token_id
    words = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in documents)
    assert tokens == words + 2 * len(documents)  # each document: its BOS, its words, an end-of-sequence
    for block in blocks.tolist():  # every document boundary inside a block: EOS then BOS
        assert all(block[i + 1] == BOS_ID for i, t in enumerate(block[:-1]) if t == eos)
    plain, _ = to_blocks(documents, tiny_tokenizer(), 16)  # a tokenizer without BOS: blocks as before
    assert (plain[:, 0] != BOS_ID).all() and plain.reshape(-1)[:15].tolist() == tiny_tokenizer()(documents[0])[
        "input_ids"
    ][:15]
