"""Supervised fine-tuning on chat data (`sft` entry point: `train.py`)."""
