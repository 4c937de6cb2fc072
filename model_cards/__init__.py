"""Model card templates (Jinja + Markdown), shipped in the wheel as `needle_hf.model_cards`.

`needle_hf.hub.model_card` renders them with `huggingface_hub.ModelCard.from_template`.
"""
