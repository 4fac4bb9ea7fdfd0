"""gpt-oss (OpenAI, 2025): model.py, flavors.py, hf.py (GptOssForCausalLM), parallelize.py."""
