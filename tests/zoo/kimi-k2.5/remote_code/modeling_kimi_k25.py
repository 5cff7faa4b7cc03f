"""Stand-in written for eagleops' tests, not Moonshot's file: the wrapper class Kimi-K2.5's
config.json names in ``auto_map``, laid out as the real checkpoint's weight map is (the
language model under ``language_model.``, the vision projector under ``mm_projector.``). The
vision tower is left out: the tests feed text only. Like Moonshot's wrapper, it does not inherit
``GenerationMixin``, so transformers (>= 4.50) gives it no ``generate``."""

from torch import nn
from transformers import DeepseekV3ForCausalLM, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class KimiK25Projector(nn.Module):
    def __init__(self, vision_width: int, text_width: int):
        super().__init__()
        merged = vision_width * 4  # 2x2 patches merged, as the real patchmerger does
        self.pre_norm = nn.LayerNorm(vision_width)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, text_width))


class KimiK25ForConditionalGeneration(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = "language_model"
    _no_split_modules = ["DeepseekV3DecoderLayer"]

    def __init__(self, config: KimiK25Config):
        super().__init__(config)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        vision_width = config.vision_config["mm_hidden_size"] // 64
        self.mm_projector = KimiK25Projector(vision_width, config.text_config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
