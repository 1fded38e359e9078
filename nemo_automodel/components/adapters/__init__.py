"""Parameter-efficient fine-tuning (LoRA with Hugging Face ``peft``)."""
