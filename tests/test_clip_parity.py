"""shoal's packed CLIP and SigLIP against transformers' CLIPModel / SiglipModel on random-initialised
checkpoints: image features, text features and a batch mixing both, each to 1e-4 in float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity import attention_meta
from shoal.layers import PackedInputs
from shoal.weights import build_model
from vision_models import (
    ATOL,
    CHANNELS,
    EOS,
    IMAGE,
    LEGACY_EOS,
    MAX_TEXT,
    PAD,
    PATCH,
    TEXT_SHAPE,
    VISION_SHAPE,
    VOCAB,
    save_random,
)


@pytest.fixture(scope="module", params=[LEGACY_EOS, EOS], ids=["clip-eos-is-max-id", "clip-eos-id"])
def clip(request, tmp_path_factory):
    eos = request.param
    config = transformers.CLIPConfig(
        text_config=dict(TEXT_SHAPE, eos_token_id=eos, bos_token_id=VOCAB - 2, pad_token_id=PAD),
        vision_config=VISION_SHAPE,
        projection_dim=24,
    )
    directory = tmp_path_factory.mktemp("clip")
    reference = save_random(transformers.CLIPModel, config, directory)
    return reference, build_model(directory, None, "cpu"), eos


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    config = transformers.SiglipConfig(
        # a text head wider than the text tower, to the vision width
        text_config=dict(TEXT_SHAPE, projection_size=48, eos_token_id=VOCAB - 1, pad_token_id=PAD),
        vision_config=VISION_SHAPE,
    )
    directory = tmp_path_factory.mktemp("siglip")
    reference = save_random(transformers.SiglipModel, config, directory)
    return reference, build_model(directory, None, "cpu")


# --- inputs -------------------------------------------------------------------------------------


def clip_texts(lengths: list[int], eos: int) -> list[torch.Tensor]:
    """Random texts ending in their end-of-text token, found by either rule: eos 2 texts end in the
    largest id (no other token reaches it); others end in `eos`, with larger ids before it."""
    g = torch.Generator().manual_seed(1)
    low, high = (3, VOCAB - 1) if eos == LEGACY_EOS else (EOS + 1, VOCAB)
    last = VOCAB - 1 if eos == LEGACY_EOS else eos
    return [torch.cat([torch.randint(low, high, (n - 1,), generator=g), torch.tensor([last])]) for n in lengths]


def siglip_texts(lengths: list[int], pad_to: int | None = None) -> list[torch.Tensor]:
    """Random texts ending in eos, right-padded with PAD to `pad_to` tokens (as SiglipProcessor's
    padding="max_length" does) when given."""
    g = torch.Generator().manual_seed(2)
    texts = [
        torch.cat([torch.randint(2, VOCAB - 1, (n - 1,), generator=g), torch.tensor([VOCAB - 1])]) for n in lengths
    ]
    if pad_to is not None:
        texts = [torch.cat([t, torch.full((pad_to - len(t),), PAD)]) for t in texts]
    return texts


def random_images(n: int, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(n, CHANNELS, size, size, generator=torch.Generator().manual_seed(3))  # [n, C, S, S]


def patch_rows(images: torch.Tensor) -> torch.Tensor:
    """`[n, C, S, S]` -> `[n * g * g, C * p * p]`: each image's patches row-major over the grid,
    each flattened in the (channel, row, col) order of the patch conv's weight."""
    n, C, S, _ = images.shape
    g = S // PATCH
    return images.reshape(n, C, g, PATCH, g, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(n * g * g, C * PATCH * PATCH)


def packed(items: list[torch.Tensor], tokens_per_image: int) -> PackedInputs:
    """Texts (`[n_i]` ids) and images (`[C, S, S]`) in one padding-free batch, in the given order: an
    image is `tokens_per_image` placeholder ids with its patch rows in the "pixels" slot."""
    is_image = [item.dim() == 3 for item in items]
    lengths = [tokens_per_image if image else len(item) for item, image in zip(items, is_image)]
    ids = torch.cat([torch.zeros(tokens_per_image, dtype=torch.long) if im else it for it, im in zip(items, is_image)])
    rows = [patch_rows(it[None]) if im else torch.empty(0, CHANNELS * PATCH * PATCH) for it, im in zip(items, is_image)]
    features = {}
    if any(is_image):
        cu_rows = torch.tensor([0] + [len(r) for r in rows]).cumsum(0).to(torch.int32)
        features = {"pixels": torch.cat(rows), "pixels_cu_rows": cu_rows}
    positions = torch.cat([torch.arange(n) for n in lengths])
    return PackedInputs(ids, positions, attention_meta(lengths), features=features)


def padded(texts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, L]` and their attention mask, as a tokenizer pads a batch."""
    ids = torch.nn.utils.rnn.pad_sequence(texts, batch_first=True, padding_value=pad_id)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(t) for t in texts], batch_first=True)
    return ids, mask


def run(model: torch.nn.Module, inputs: PackedInputs) -> torch.Tensor:
    with torch.inference_mode():
        return model(inputs)


def max_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.shape == expected.shape, f"{tuple(got.shape)} != {tuple(expected.shape)}"
    return (got - expected).abs().max().item()


# --- CLIP ---------------------------------------------------------------------------------------

CLIP_TOKENS = (IMAGE // PATCH) ** 2 + 1  # the class token first


def clip_text_reference(reference, texts: list[torch.Tensor], eos: int) -> torch.Tensor:
    # openai's tokenizer pads with the end-of-text token: the first one is the text's own
    ids, mask = padded(texts, pad_id=eos if eos != LEGACY_EOS else PAD)
    with torch.no_grad():
        return reference.get_text_features(input_ids=ids, attention_mask=mask).pooler_output


def clip_image_reference(reference, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference.get_image_features(pixel_values=images).pooler_output


def test_clip_image_features_match_transformers(clip):
    reference, ours, _ = clip
    images = random_images(4)
    assert ours.tokens_per_image == CLIP_TOKENS
    diff = max_diff(run(ours, packed(list(images), CLIP_TOKENS)), clip_image_reference(reference, images))
    assert diff <= ATOL, f"image features differ by {diff}"


def test_clip_text_features_of_mixed_lengths_match_transformers_pooled_at_end_of_text(clip):
    reference, ours, eos = clip
    texts = clip_texts([5, MAX_TEXT, 2, 13, 1], eos)
    diff = max_diff(run(ours, packed(texts, CLIP_TOKENS)), clip_text_reference(reference, texts, eos))
    assert diff <= ATOL, f"text features differ by {diff}"
    assert ours.max_positions == MAX_TEXT


def test_clip_batch_mixing_texts_and_images_matches_each_tower_and_the_logits(clip):
    reference, ours, eos = clip
    texts, images = clip_texts([7, 3, MAX_TEXT], eos), random_images(3)
    items = [texts[0], images[0], images[1], texts[1], images[2], texts[2]]
    got = run(ours, packed(items, CLIP_TOKENS))  # [6, projection_dim]
    expected_texts = clip_text_reference(reference, texts, eos)
    expected_images = clip_image_reference(reference, images)
    expected = torch.stack([expected_texts[0], expected_images[0], expected_images[1], expected_texts[1]])
    expected = torch.cat([expected, expected_images[2:], expected_texts[2:]])
    diff = max_diff(got, expected)
    assert diff <= ATOL, f"mixed-batch features differ by {diff}"

    ids, mask = padded(texts, pad_id=eos if eos != LEGACY_EOS else PAD)
    with torch.no_grad():
        logits = reference(input_ids=ids, pixel_values=images, attention_mask=mask).logits_per_text  # [3, 3]
    diff = max_diff(ours.logits(got[[0, 3, 5]], got[[1, 2, 4]]), logits)
    assert diff <= ATOL * 10, f"logits differ by {diff}"  # scaled by exp(2.3) ~ 10


# --- SigLIP -------------------------------------------------------------------------------------

SIGLIP_TOKENS = (IMAGE // PATCH) ** 2  # no class token


def siglip_text_reference(reference, texts: list[torch.Tensor]) -> torch.Tensor:
    """Texts of one length as one batch with no attention mask, as SiglipModel sees a processor's
    max_length-padded ids; texts of several lengths one at a time."""
    with torch.no_grad():
        if len({len(t) for t in texts}) == 1:
            return reference.get_text_features(input_ids=torch.stack(texts)).pooler_output
        return torch.cat([reference.get_text_features(input_ids=t[None]).pooler_output for t in texts])


def siglip_image_reference(reference, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference.get_image_features(pixel_values=images).pooler_output


def test_siglip_image_features_match_transformers(siglip):
    reference, ours = siglip
    images = random_images(4)
    assert ours.tokens_per_image == SIGLIP_TOKENS
    diff = max_diff(run(ours, packed(list(images), SIGLIP_TOKENS)), siglip_image_reference(reference, images))
    assert diff <= ATOL, f"image features differ by {diff}"


def test_siglip_text_features_of_texts_padded_to_max_length_match_transformers(siglip):
    reference, ours = siglip
    texts = siglip_texts([4, 11, 2], pad_to=MAX_TEXT)
    diff = max_diff(run(ours, packed(texts, SIGLIP_TOKENS)), siglip_text_reference(reference, texts))
    assert diff <= ATOL, f"text features differ by {diff}"
    # the pad tokens are attended to: unpadded, the same texts embed differently
    unpadded = run(ours, packed(siglip_texts([4, 11, 2]), SIGLIP_TOKENS))
    assert max_diff(unpadded, siglip_text_reference(reference, texts)) > 1e-2


def test_siglip_text_features_of_unpadded_mixed_lengths_match_transformers(siglip):
    reference, ours = siglip
    texts = siglip_texts([4, MAX_TEXT, 1, 9])
    diff = max_diff(run(ours, packed(texts, SIGLIP_TOKENS)), siglip_text_reference(reference, texts))
    assert diff <= ATOL, f"text features differ by {diff}"


def test_siglip_batch_mixing_texts_and_images_matches_each_tower_and_the_logits(siglip):
    reference, ours = siglip
    texts, images = siglip_texts([5, 9], pad_to=MAX_TEXT), random_images(3)
    items = [images[0], texts[0], images[1], images[2], texts[1]]
    got = run(ours, packed(items, SIGLIP_TOKENS))  # [5, hidden]
    expected_texts = siglip_text_reference(reference, texts)
    expected_images = siglip_image_reference(reference, images)
    expected = torch.stack([expected_images[0], expected_texts[0], expected_images[1], expected_images[2]])
    diff = max_diff(got, torch.cat([expected, expected_texts[1:]]))
    assert diff <= ATOL, f"mixed-batch features differ by {diff}"

    with torch.no_grad():
        logits = reference(input_ids=torch.stack(texts), pixel_values=images).logits_per_text  # [2, 3]
    diff = max_diff(ours.logits(got[[1, 4]], got[[0, 2, 3]]), logits)
    assert diff <= ATOL * 10, f"logits differ by {diff}"  # scaled by exp(2.3) ~ 10


# --- resolution ---------------------------------------------------------------------------------


def test_an_image_of_another_resolution_is_refused_with_the_patch_count_the_model_takes(clip, siglip):
    small = random_images(1, size=IMAGE - PATCH)  # 9 patches, not 16
    for model, tokens in ((clip[1], 9 + 1), (siglip[1], 9)):
        with pytest.raises(ValueError, match="9 patches .* takes 32x32 images: 16 patches"):
            run(model, packed([siglip_texts([3])[0], small[0]], tokens))
