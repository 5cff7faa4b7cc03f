"""Stand-in written for eagleops' tests, not Moonshot's file: the class Kimi-K2.5's config.json
names in ``auto_map["AutoConfig"]``, so that loading it needs ``trust_remote_code`` as the real
one does. It holds the language model's config as DeepSeek-V3's (the architecture Kimi's
``kimi_k2`` text model is) and keeps the wrapper's own keys."""

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, **kwargs):
        if isinstance(text_config, dict):
            fields = {k: v for k, v in text_config.items() if k != "model_type"}
            text_config = DeepseekV3Config(**fields)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        self.vision_config = vision_config or {}
        super().__init__(**kwargs)

    def to_dict(self):
        data = super().to_dict()
        data["text_config"] = self.text_config.to_dict()
        data["text_config"]["model_type"] = "kimi_k2"
        return data
