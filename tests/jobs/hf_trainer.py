"""A Hugging Face ``Trainer`` (on ``accelerate``) fine-tuning a tiny BERT built
from its config (nothing downloaded) on random tokens held in memory, with a
callback that logs each step's end (step_log.py)."""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import torch

from tests.jobs.step_log import StepLog, arguments, enable_probe


def main() -> int:
    parser = arguments(__doc__ or "")
    parser.add_argument("--sequence", type=int, default=32)
    args = parser.parse_args()
    enable_probe()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128,
                        max_position_embeddings=args.sequence)
    model = BertForSequenceClassification(config)

    class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self, size: int) -> None:
            self.tokens = torch.randint(0, config.vocab_size, (size, args.sequence))
            self.labels = torch.randint(0, 2, (size,))

        def __len__(self) -> int:
            return len(self.labels)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.tokens[index],
                    "attention_mask": torch.ones(args.sequence, dtype=torch.long),
                    "labels": self.labels[index]}

    log = StepLog(args, "hf_trainer")

    class StepEnds(TrainerCallback):  # type: ignore[misc,unused-ignore]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if log.step_ended():
                control.should_training_stop = True
            return control

    with tempfile.TemporaryDirectory() as output:
        training = TrainingArguments(
            output_dir=output, per_device_train_batch_size=args.batch, max_steps=100_000,
            use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-4)
        trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(4096),
                          callbacks=[StepEnds()])
        trainer.train()
    log.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
