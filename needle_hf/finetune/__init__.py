"""Fine-tuning: the JSONL data format and collators, the Needle loss for transformers' `Trainer`
(`trainer`), TRL's `SFTTrainer` (`trainer_trl`), the optax loop (`trainer_flax`), and the tool
routing and confidence heads' objectives (`heads`)."""
