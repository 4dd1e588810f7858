"""POST /v1/completions: prompts (text or token ids) -> choices, whole or streamed, with echo and logprobs."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine.detokenizer import IncrementalDetokenizer
from .context import ServingContext, sse
from .protocol import bad, completion_logprobs, parse_completion, usage

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    ctx: ServingContext = request.app.state.serving
    body = await ctx.read_json(request)
    req = parse_completion(body, ctx.vocab_size)
    common = req.common
    prompts = [await ctx.tokenize(p, True, "prompt") if isinstance(p, str) else list(p) for p in req.prompts]
    jobs = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad("prompt", f"prompt[{i}] has no tokens")
        max_tokens = ctx.budget(ids, common.max_tokens, f"prompt[{i}]" if len(prompts) > 1 else "the prompt")
        jobs += [(ids, common.sampling(max_tokens, j)) for j in range(common.n)]
    name = f"cmpl-{uuid.uuid4().hex[:24]}"
    ids, queue = await ctx.submit(jobs, name, "response_format")
    echoes = [await run_in_threadpool(_echo, ctx.tokenizer, p) for p in prompts] if req.echo else None
    head = {"id": name, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name}
    if common.stream:
        return StreamingResponse(_stream(ctx, ids, queue, head, req, echoes, prompts), media_type="text/event-stream")
    finals = await ctx.wait_all(request, ids, queue)
    choices = [
        await run_in_threadpool(_choice, ctx, i, finals[rid], req, echoes and echoes[i // common.n])
        for i, rid in enumerate(ids)
    ]
    completion = sum(len(finals[rid].token_ids) for rid in ids)
    return dict(head, choices=choices, usage=usage(sum(map(len, prompts)), completion))


def _choice(ctx: ServingContext, index: int, out, req, echo) -> dict:
    text, logprobs = out.text, None
    if req.common.logprobs is not None:
        pieces = _pieces(out.text, out.token_offsets, len(out.token_ids))
        entries = list(out.logprobs or [])
        if echo is not None:
            pieces, entries = echo[1] + pieces, list(out.prompt_logprobs or [None] * len(echo[1])) + entries
        logprobs = completion_logprobs(entries, ctx.token_text, pieces, 0)
    if echo is not None:
        text = echo[0] + text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}


async def _stream(ctx: ServingContext, ids, queue, head, req, echoes, prompts):
    common, index = req.common, {rid: i for i, rid in enumerate(ids)}
    sent = dict.fromkeys(ids, 0)  # generated tokens already streamed, per choice
    started, left, completion = set(), set(ids), 0

    def chunk(i, text, logprobs, finish_reason):
        return sse(
            dict(head, choices=[{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])
        )

    try:
        while left:
            out = await queue.get()
            rid, i = out.request_id, index[out.request_id]
            text, logprobs = out.new_text, None
            if common.logprobs is not None:
                pieces = _pieces(out.text, out.token_offsets, len(out.token_ids))[sent[rid] :]
                entries = list(out.logprobs or [])[sent[rid] :]
                if echoes is not None and rid not in started:
                    echo = echoes[i // common.n]
                    pieces = echo[1] + pieces
                    entries = list(out.prompt_logprobs or [None] * len(echo[1])) + entries
                logprobs = completion_logprobs(entries, ctx.token_text, pieces, 0)
                sent[rid] = len(out.token_ids)
            if echoes is not None and rid not in started:
                text = echoes[i // common.n][0] + text
            started.add(rid)
            if text or logprobs and logprobs["tokens"]:
                yield chunk(i, text, logprobs, None)
            if out.finished:
                left.discard(rid)
                completion += len(out.token_ids)
                yield chunk(i, "", None, out.finish_reason)
        if common.include_usage:
            yield sse(dict(head, choices=[], usage=usage(sum(map(len, prompts)), completion)))
        yield "data: [DONE]\n\n"
    finally:  # the client went away mid-stream: free the blocks
        ctx.thread.abort([rid for rid in ids if rid in left])


def _echo(tokenizer, prompt_ids: list[int]) -> tuple[str, list[str]]:
    """A prompt's text (= decode(prompt)) and each token's piece of it ("".join(pieces) == text)."""
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in prompt_ids:
        detok.add(token)
    detok.text += detok.flush()
    return detok.text, _pieces(detok.text, detok.offsets, len(prompt_ids))


def _pieces(text: str, offsets: list[int], count: int) -> list[str]:
    """Token i's text: text[offsets[i]:offsets[i + 1]] (a token whose character a later one completes gets "")."""
    offsets = list(offsets[:count]) + [len(text)] * (count - len(offsets))
    return [text[start:stop] for start, stop in zip(offsets, offsets[1:] + [len(text)])]
