"""Training: corpus, tokenizer, target model, evaluation prompts (and, later, drafter and calibration)."""
