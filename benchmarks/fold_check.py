"""The real target with its norms folded or as loaded (argv[1]: 1 or 0; fused_layer.fold_model_norms):
its greedy outputs (256 tokens at 16K, Python and Node.js docs) and the decode path's teacher-forced
agreement with each document's own next 256 tokens after 8192 of it (top-1 rate, mean NLL); JSON to
argv[2]. Compare two runs' outputs for where they first part.

    python benchmarks/fold_check.py 1 /tmp/fold1.json && python benchmarks/fold_check.py 0 /tmp/fold0.json
"""
import json
import sys

import torch

from specextend.models import loader
loader.FOLD_NORMS = sys.argv[1] == "1"
from specextend.builder import build_engine  # noqa: E402
from specextend.config import EngineConfig, SamplingParams  # noqa: E402
from specextend.bench import texts  # noqa: E402
from specextend.target import TargetSession  # noqa: E402

eng = build_engine(EngineConfig(mode="ar", device="cuda"))
tok = eng.target.tokenizer
dec = eng.target.decoder
print("folded layers:", type(dec.w.layers[0]).__name__, flush=True)
out = {}
for doc in texts.documents(["python", "nodejs"]):
    ids = texts.prompt_ids(tok, doc, 16384)
    toks, _, _ = eng.generate(ids, SamplingParams(max_new_tokens=256, ignore_eos=True))
    # teacher forcing through the decode path: the document's own next 256 tokens after 8192 of it
    body = ids[:8192]
    nxt = ids[8192:8192 + 256]
    s = TargetSession(dec, 8192 + 300, hybrid=True)
    logits = s.prefill(body, 4096)
    hit, nll = 0, 0.0
    for t in nxt:
        lp = torch.log_softmax(logits.float().view(-1, logits.shape[-1])[-1], -1)
        hit += int(lp.argmax().item() == t)
        nll -= lp[t].item()
        logits = s.decode(t)
    r = out[doc.name] = dict(tokens=toks, text=tok.decode(toks)[:300], forced_top1=hit / len(nxt),
                             forced_nll=nll / len(nxt))
    print(doc.name, r["forced_top1"], r["forced_nll"], repr(r["text"][:120]), flush=True)
json.dump(out, open(sys.argv[2], "w"))
