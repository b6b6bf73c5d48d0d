"""An image-text checkpoint's vision side, beside batchq's own decoder: the image processor that turns an
image into patches (the checkpoint's preprocessor_config.json through Hugging Face's PIL backend: no
torchvision), the vision tower that turns them into embeddings at the decoder's width (Hugging Face's own
modules, their weights from the checkpoint's files), and where the embeddings go in the prompt.

LLaVA-1.5: each image is the tower's square, a fixed count of `<image>` tokens (LlavaTower). Qwen2-VL: an image of grid (t, h, w) patches takes t * h * w / merge^2 `<|image_pad|>` tokens (the chat
template writes one per image; `expand` repeats it), and its tokens rotate by three positions each (M-RoPE:
temporal, height, width; `mrope_positions`, Hugging Face's get_rope_index for one sequence).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# The tower's tensors in an image-text checkpoint, by layout: Qwen2-VL's original names and transformers'
# newer ones.
TOWER_PREFIXES = ("visual.", "model.visual.")


class ImageError(ValueError):
    """An image the model cannot take (undecodable, or of a mode or size the processor refuses)."""


@dataclass
class PreparedImages:
    """A request's images, processed: patches [N, C * t * p * p] of all of them, each one's grid (t, h, w)
    of patches, the decoder tokens each takes, and each one's content digest (sha256 of its bytes)."""

    pixel_values: Tensor
    grids: list[tuple[int, int, int]]
    tokens: list[int]
    digests: list[str]


class VisionTower:
    """What every family's vision side does: `prepare` a request's images (CPU work), `encode` them into
    the decoder's embeddings, `expand` the prompt's placeholders; `mrope`: whether its decoder rotates
    image tokens by three positions each (`mrope_positions`)."""

    image_token_id: int
    mrope = False
    settings: dict[str, Any]  # the image processor's (preprocessor_config.json, as taken)

    def modules(self) -> list[torch.nn.Module]:
        """Its modules with weights: what, with `settings`, decides an image's embeddings (the fingerprint)."""
        return [m for m in (getattr(self, "tower", None), getattr(self, "projector", None)) if m is not None]

    def prepare(self, images: list[bytes]) -> PreparedImages:
        raise NotImplementedError

    def encode(self, prepared: PreparedImages) -> list[Tensor]:
        raise NotImplementedError

    def mrope_positions(self, ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[Tensor, int]:
        raise NotImplementedError

    def expand(self, ids: list[int], tokens: list[int]) -> list[int]:
        """The prompt's ids with each image's one placeholder repeated to the tokens it takes (in order);
        ImageError where the prompt's placeholders and the images do not pair up."""
        found = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(found) != len(tokens):
            raise ImageError(f"the prompt has {len(found)} image placeholders for {len(tokens)} images")
        out, last = [], 0
        for at, n in zip(found, tokens, strict=True):
            out += ids[last:at] + [self.image_token_id] * n
            last = at + 1
        return out + ids[last:]


def processor_settings(folder: Path) -> dict[str, Any]:
    """The checkpoint's preprocessor_config.json as an image processor's settings (none: its defaults)."""
    path = folder / "preprocessor_config.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    return {k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")}


def decoded(i: int, data: bytes) -> Any:
    """Image `i` of a request as RGB (Pillow), or ImageError saying why it is not one."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")
    except Exception as e:  # Pillow raises several types for a file it cannot decode
        raise ImageError(f"image {i}: not a decodable image ({e})") from None


# Hugging Face's tower module per Qwen family (Qwen2.5-VL's windows its attention in most blocks)
QWEN_TOWERS = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
    ),
}


def processed(processor: Any, i: int, data: bytes) -> Any:
    """Image `i` through the model's image processor; ImageError where it refuses the image (Qwen2-VL's
    refuses one too thin or of too extreme an aspect ratio): one request's image never fails the engine."""
    image = decoded(i, data)
    try:
        return processor(images=[image], return_tensors="pt")
    except Exception as e:  # the processors raise ValueError and others for images they cannot size
        raise ImageError(f"image {i}: the model's image processor refuses it ({e})") from None


class Qwen2VLTower(VisionTower):
    """hf_config: the image-text model's config (its vision_config, the image token's id)."""

    mrope = True

    def __init__(self, folder: Path, hf_config: Any, dtype: torch.dtype, device: torch.device) -> None:
        import importlib

        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        module, name = QWEN_TOWERS[hf_config.model_type]
        tower_class: Any = getattr(importlib.import_module(module), name)
        vision = hf_config.vision_config
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(vision.spatial_merge_size)
        self.dtype, self.device = dtype, device
        settings = self.settings = processor_settings(folder)
        settings.setdefault("patch_size", vision.patch_size)
        settings.setdefault("temporal_patch_size", vision.temporal_patch_size)
        settings.setdefault("merge_size", self.merge)
        self.processor = Qwen2VLImageProcessorPil(**settings)
        with torch.device("meta"):
            tower = tower_class._from_config(vision, dtype=dtype)
        state = _tower_weights(folder)
        tower.load_state_dict(state, strict=True, assign=True)
        # (the rotary's inv_freq buffers Hugging Face computes; they are no checkpoint tensors)
        inv_freq = tower.rotary_pos_emb.compute_axial_rope_parameters(vision)[0]
        tower.rotary_pos_emb.inv_freq, tower.rotary_pos_emb.original_inv_freq = inv_freq, inv_freq.clone()
        left = [n for n, b in tower.named_buffers() if b.is_meta]
        assert not left, f"vision tower buffers not set: {left}"
        self.tower = tower.to(device=device, dtype=dtype).eval()
        log.info("vision tower: %s, %d blocks, patches of %d px merged %dx%d per token", name, vision.depth,
                 vision.patch_size, self.merge, self.merge)  # fmt: skip

    def prepare(self, images: list[bytes]) -> PreparedImages:
        """Decode and process a request's images (CPU work, off the engine's step): ImageError names which
        image cannot be taken."""
        pixels, grids, tokens, digests = [], [], [], []
        for i, data in enumerate(images):
            out = processed(self.processor, i, data)
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            pixels.append(out["pixel_values"])
            grids.append((grid[0], grid[1], grid[2]))
            tokens.append(grid[0] * grid[1] * grid[2] // self.merge**2)
            digests.append(hashlib.sha256(data).hexdigest())
        return PreparedImages(torch.cat(pixels), grids, tokens, digests)

    @torch.inference_mode()
    def encode(self, prepared: PreparedImages) -> list[Tensor]:
        """Each image's embeddings [tokens, decoder hidden], one image per call of the tower: an image's
        numbers never depend on the others encoded beside it."""
        out, at = [], 0
        for (t, h, w), n in zip(prepared.grids, prepared.tokens, strict=True):
            patches = prepared.pixel_values[at : at + t * h * w].to(self.device, self.dtype)
            at += t * h * w
            grid = torch.tensor([[t, h, w]], device=self.device)
            emb = self.tower(patches, grid_thw=grid).pooler_output
            assert emb.shape[0] == n, f"the tower gave {emb.shape[0]} embeddings for an image of {n} tokens"
            out.append(emb)
        return out

    def mrope_positions(self, ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[Tensor, int]:
        """Each prompt token's (temporal, height, width) positions [3, len] and the delta that later tokens
        add to their own position (Hugging Face's get_rope_index): text runs count on from the largest
        position so far; an image's tokens take its grid's coordinates after it."""
        cols: list[Tensor] = []
        cur, i, image = 0, 0, iter(grids)
        while i < len(ids):
            j = i
            is_image = ids[i] == self.image_token_id
            while j < len(ids) and (ids[j] == self.image_token_id) == is_image:
                j += 1
            if not is_image:
                cols.append(torch.arange(cur, cur + j - i).expand(3, -1))
                cur += j - i
            else:
                t, h, w = next(image)
                gh, gw = h // self.merge, w // self.merge
                tt, hh, ww = torch.meshgrid(
                    torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"
                )
                cols.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
                cur += max(gh, gw)
            i = j
        pos = torch.cat(cols, dim=1) if cols else torch.zeros(3, 0, dtype=torch.int64)
        return pos, int(pos.max()) + 1 - len(ids) if len(ids) else 0


def _tower_weights(folder: Path, prefixes: tuple[str, ...] = TOWER_PREFIXES) -> dict[str, Tensor]:
    """The checkpoint's tensors under `prefixes` (any of them), the prefix taken off."""
    from safetensors import safe_open

    state: dict[str, Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                for prefix in prefixes:
                    if name.startswith(prefix):
                        state[name.removeprefix(prefix)] = st.get_tensor(name)
    if not state:
        raise ImageError(f"{folder}: no tensors named {' / '.join(prefixes)}* in its safetensors")
    return state


class LlavaTower(VisionTower):
    """LLaVA-1.5: a CLIP vision tower (one of its hidden layers, the class token dropped under the
    "default" strategy) and a two-layer projector; every image is resized and cropped to the tower's
    square, (size / patch)^2 tokens. The decoder is the text config's family, 1-D positions."""

    def __init__(self, folder: Path, hf_config: Any, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModel
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        vision = hf_config.vision_config
        self.image_token_id = int(hf_config.image_token_id)
        self.layer, self.strategy = hf_config.vision_feature_layer, hf_config.vision_feature_select_strategy
        if not isinstance(self.layer, int) or self.strategy not in ("default", "full"):
            raise ImageError(f"LLaVA vision_feature_layer {self.layer!r} / select strategy {self.strategy!r}: "
                             "batchq takes one layer, and the default or full strategy")  # fmt: skip
        self.dtype, self.device = dtype, device
        side = int(vision.image_size) // int(vision.patch_size)
        self.tokens = side * side + (1 if self.strategy == "full" else 0)
        self.settings = processor_settings(folder)
        self.processor = LlavaImageProcessorPil(**self.settings)
        tower = AutoModel.from_config(vision)  # type: ignore[no-untyped-call]
        projector = LlavaMultiModalProjector(hf_config)
        weights = _tower_weights(folder, ("vision_tower.", "model.vision_tower."))
        tower.load_state_dict(_matching(weights, tower.state_dict()), strict=True)
        state = _tower_weights(folder, ("multi_modal_projector.", "model.multi_modal_projector."))
        projector.load_state_dict(state, strict=True)
        self.tower = tower.to(device=device, dtype=dtype).eval()
        self.projector = projector.to(device=device, dtype=dtype).eval()

    def prepare(self, images: list[bytes]) -> PreparedImages:
        pixels, digests = [], []
        for i, data in enumerate(images):
            pixels.append(processed(self.processor, i, data)["pixel_values"])
            digests.append(hashlib.sha256(data).hexdigest())
        n = len(images)
        return PreparedImages(torch.cat(pixels), [(1, 0, 0)] * n, [self.tokens] * n, digests)

    @torch.inference_mode()
    def encode(self, prepared: PreparedImages) -> list[Tensor]:
        out = []
        for px in prepared.pixel_values:  # one image per call: its numbers never follow the others'
            hidden = self.tower(px[None].to(self.device, self.dtype), output_hidden_states=True).hidden_states
            feats = hidden[self.layer]
            out.append(self.projector(feats[:, 1:] if self.strategy == "default" else feats)[0])
        return out


def _matching(weights: dict[str, Tensor], wanted: dict[str, Tensor]) -> dict[str, Tensor]:
    """A tower's checkpoint tensors under the module's own names: checkpoints name CLIP's tensors with
    and without its "vision_model." level."""
    out = {}
    for name, t in weights.items():
        for cand in (name, "vision_model." + name, name.removeprefix("vision_model.")):
            if cand in wanted:
                out[cand] = t
                break
        else:
            raise ImageError(f"vision tower tensor {name!r}: the tower has no such parameter")
    return out


FAMILIES = {"qwen2_vl": Qwen2VLTower, "qwen2_5_vl": Qwen2VLTower, "llava": LlavaTower}


def load_vision(folder: Path, hf_config: Any, dtype: torch.dtype, device: torch.device) -> VisionTower | None:
    """The vision side of an image-text checkpoint batchq runs images through (FAMILIES), else None."""
    family = FAMILIES.get(str(getattr(hf_config, "model_type", None)))
    return None if family is None else family(folder, hf_config, dtype, device)
