"""Stand-in written for eagleops' tests, not Moonshot's file: the wrapper class Kimi-K2.5's
config.json names in ``auto_map``, laid out as the real checkpoint's weight map is (the
language model under ``language_model.``, the vision tower under ``vision_tower.``, the
projector under ``mm_projector.``). The vision tower and projector only hold their weights,
in the real module tree and the shapes the config gives: the tests feed text only, so nothing
here runs an image. Like Moonshot's wrapper, it does not inherit ``GenerationMixin``, so
transformers (>= 4.50) gives it no ``generate``."""

import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class MLP2(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(width, hidden)
        self.fc1 = nn.Linear(hidden, width)


class MoonViTEncoderLayer(nn.Module):
    def __init__(self, width: int, mlp_width: int):
        super().__init__()
        self.norm0 = nn.LayerNorm(width)
        self.norm1 = nn.LayerNorm(width)
        self.wqkv = nn.Linear(width, 3 * width)
        self.wo = nn.Linear(width, width)
        self.mlp = MLP2(width, mlp_width)


class MoonViTEncoder(nn.Module):
    def __init__(self, vision: dict):
        super().__init__()
        width = vision["vt_hidden_size"]
        self.blocks = nn.ModuleList(
            MoonViTEncoderLayer(width, vision["vt_intermediate_size"]) for _ in range(vision["vt_num_hidden_layers"])
        )
        self.final_layernorm = nn.LayerNorm(width)


class PositionEmbedding(nn.Module):
    def __init__(self, height: int, width: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(height, width, dim))


class MoonVisionPatchEmbed(nn.Module):
    def __init__(self, vision: dict):
        super().__init__()
        width, patch = vision["vt_hidden_size"], vision["patch_size"]
        self.proj = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.pos_emb = PositionEmbedding(vision["init_pos_emb_height"], vision["init_pos_emb_width"], width)


class MoonViT(nn.Module):
    def __init__(self, vision: dict):
        super().__init__()
        self.patch_embed = MoonVisionPatchEmbed(vision)
        self.encoder = MoonViTEncoder(vision)


class KimiK25Projector(nn.Module):
    def __init__(self, vision: dict, text_width: int):
        super().__init__()
        width = vision["mm_hidden_size"]
        merge_height, merge_width = vision["merge_kernel_size"]
        merged = width * merge_height * merge_width  # the patches merged, as the real patchmerger does
        self.pre_norm = nn.LayerNorm(width)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, text_width))


class KimiK25ForConditionalGeneration(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = "language_model"
    _no_split_modules = ["DeepseekV3DecoderLayer"]

    def __init__(self, config: KimiK25Config):
        super().__init__(config)
        self.vision_tower = MoonViT(config.vision_config)
        self.mm_projector = KimiK25Projector(config.vision_config, config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
