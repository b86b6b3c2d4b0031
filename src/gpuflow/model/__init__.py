"""The model: a GPT whose embedding runs on the device, and its fused output head."""
