"""A hand-written loop with manual SGD and no torch.optim (as pytorch/examples'
word_language_model): a small LSTM language model on random tokens held in
memory, each step's end logged (step_log.py)."""

from __future__ import annotations

import sys

import torch
from torch import nn

from tests.jobs.step_log import StepLog, arguments, enable_probe


class WordModel(nn.Module):
    def __init__(self, vocabulary: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.lstm = nn.LSTM(width, width, num_layers=2)
        self.decoder = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embedding(tokens))
        decoded: torch.Tensor = self.decoder(output)
        return decoded


def main() -> int:
    args = arguments(__doc__ or "").parse_args()
    enable_probe()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = WordModel()
    loss_fn = nn.CrossEntropyLoss()
    tokens = torch.randint(0, 1000, (35, args.batch))
    targets = torch.randint(0, 1000, (35 * args.batch,))
    log = StepLog(args, "manual_sgd")
    while True:
        model.zero_grad()
        output = model(tokens)
        loss = loss_fn(output.view(-1, 1000), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.add_(parameter.grad, alpha=-0.1)
        if log.step_ended():
            break
    log.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
