"""A fake `python -m vllm.entrypoints.openai.api_server`: the command line the rig builds, vLLM's
empty-body 200 on /health, its /v1/models entry and its streamed completion chunks (`stop_reason`,
`usage: null` on every chunk, a final usage chunk with `choices: []`) and /tokenize. Its tokenizer
is one token per whitespace-separated word after `<bos>` (id 2); token-id prompts are taken as they are.

FAKE_VLLM_MODE picks a failure while starting: `exit` (dies with a message), `hang` (never listens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ITL_S = 0.004


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--host", "--port", "--dtype", "--seed", "--max-model-len", "--max-num-seqs",
                 "--served-model-name", "--api-key"):
        parser.add_argument(name)
    parser.add_argument("--no-enable-prefix-caching", action="store_true")
    args, _ = parser.parse_known_args()
    mode = os.environ.get("FAKE_VLLM_MODE")
    print(f"fake vllm: {' '.join(sys.argv[1:])}", flush=True)
    if mode == "exit":
        time.sleep(0.3)
        sys.exit("ValueError: fake vLLM cannot load this model")
    if mode == "hang":
        time.sleep(3600)
    uvicorn.run(build_app(args), host=args.host, port=int(args.port), log_level="warning")


def build_app(args) -> FastAPI:
    app = FastAPI()
    served = args.served_model_name or args.model
    max_model_len = int(args.max_model_len or 2048)
    created = int(time.time())

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": created, "owned_by": "vllm", "root": args.model,
            "parent": None, "max_model_len": max_model_len, "permission": []}]}

    def encode(text: str) -> list[int]:
        return [2, *(3 + sum(map(ord, word)) % 997 for word in text.split())]

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        tokens = encode(body["prompt"])
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": None}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = encode(prompt)
        elif not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return JSONResponse({"error": {"message": "prompt: a string or token ids", "type": "BadRequestError",
                                           "code": 400}}, status_code=400)
        n_out = body.get("max_tokens") or 16
        rid = f"cmpl-{uuid.uuid4().hex}"

        def chunk(choices, usage=None) -> str:
            return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": int(time.time()),
                                          "model": served, "choices": choices, "usage": usage}) + "\n\n"

        async def stream():
            await asyncio.sleep(0.01 + len(prompt) * 1e-5)
            for k in range(n_out):
                if k:
                    await asyncio.sleep(ITL_S)
                last = k + 1 == n_out
                choice = {"index": 0, "text": f" t{k}", "logprobs": None,
                          "finish_reason": "length" if last else None, "stop_reason": None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [100 + k]
                yield chunk([choice])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk([], {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n_out,
                                 "completion_tokens": n_out, "prompt_tokens_details": None})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    main()
