"""Tokenization: the offline Qwen3 tokenizer, prompt rendering and stateless detokenization."""
