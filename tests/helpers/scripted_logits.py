"""A logits processor for server tests (`ouro serve --logits-processors
tests.helpers.scripted_logits:ScriptedReply`, the repository root on the path):
when a prompt contains the trigger text, the reply is forced to a scripted text token by token
(then EOS), so tool-call and reasoning output can be produced by a random-init model."""

import json
import os

import torch


class ScriptedReply:
    def __init__(self, model_dir):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        script = json.loads(open(os.environ["OURO_SCRIPTED_REPLY"]).read())
        self.scripts = [(self.tok.encode(s["trigger"], add_special_tokens=False).ids,
                         self.tok.encode(s["reply"], add_special_tokens=False).ids + [s.get("eos", 0)])
                        for s in script]

    def __call__(self, prompt_ids, output_ids, logits):
        # the trigger seen last in the prompt wins (a conversation repeats earlier turns)
        found = [(_last(prompt_ids, trigger), reply) for trigger, reply in self.scripts]
        found = [f for f in found if f[0] >= 0]
        if not found:
            return logits
        reply = max(found, key=lambda f: f[0])[1]
        k = min(len(output_ids), len(reply) - 1)
        forced = torch.full_like(logits, float("-inf"))
        forced[reply[k]] = 0.0
        return forced


def _last(seq, sub):
    n = len(sub)
    return max((i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub), default=-1) if n else -1
