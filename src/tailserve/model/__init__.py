"""Hugging Face checkpoint loading and the Llama-family decoder."""
