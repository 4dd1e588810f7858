"""POST /v1/chat/completions: messages through the chat template -> choices, whole or streamed, with tool calls
(tools.py) and logprobs."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from .context import ServingContext, sse
from .protocol import bad, chat_logprobs, parse_chat, usage
from .tools import ToolPlan, parse_output, read_tools

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(request: Request):
    ctx: ServingContext = request.app.state.serving
    body = await ctx.read_json(request)
    req = parse_chat(body)
    plan = read_tools(body)
    common, tokenizer = req.common, ctx.tokenizer
    if plan.active and common.response_format is not None:
        raise bad("response_format", "cannot be combined with tools unless tool_choice is 'none'")
    common.grammar = plan.grammar
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad("messages", "this model's tokenizer has no chat template; use /v1/completions")
    try:
        text = await run_in_threadpool(
            tokenizer.apply_chat_template,
            req.messages,
            tools=plan.tools or None,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as error:  # a template that rejects the roles or their order
        raise bad("messages", f"the chat template failed: {str(error)[:200]}") from None
    prompt = await ctx.tokenize(text, False, "messages")
    if not prompt:
        raise bad("messages", "the chat template produced no tokens")
    max_tokens = ctx.budget(prompt, common.max_tokens, "the chat prompt")
    name = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    ids, queue = await ctx.submit(
        [(prompt, common.sampling(max_tokens, j)) for j in range(common.n)],
        name,
        "tools" if plan.active else "response_format",
    )
    head = {"id": name, "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name}
    if common.stream:
        head["object"] = "chat.completion.chunk"
        return StreamingResponse(_stream(ctx, ids, queue, head, req, plan, len(prompt)), media_type="text/event-stream")
    finals = await ctx.wait_all(request, ids, queue)
    choices = []
    for i, rid in enumerate(ids):
        out = finals[rid]
        content, calls = parse_output(plan, out.text, cut=out.finish_reason == "length")
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if req.top_logprobs is not None:
            logprobs = {"content": chat_logprobs(out.logprobs or [], ctx.token_text, req.top_logprobs)}
        reason = _finish_reason(out.finish_reason, calls)
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
    completion = sum(len(finals[rid].token_ids) for rid in ids)
    return dict(head, choices=choices, usage=usage(len(prompt), completion))


async def _stream(ctx: ServingContext, ids, queue, head, req, plan: ToolPlan, prompt_tokens: int):
    """Content streams as it comes. With tools the answer is held until it is known to be text (tool_choice
    "auto": its first character is not "<") or, for a call, until its end (one tool_calls delta)."""
    index, sent, left, completion = {rid: i for i, rid in enumerate(ids)}, dict.fromkeys(ids, 0), set(ids), 0
    held = dict.fromkeys(ids, "")  # text (new_text of the outputs) not streamed yet
    texting = set(ids) if not plan.active else set()

    def chunk(i, delta, finish_reason=None, logprobs=None):
        return sse(
            dict(head, choices=[{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])
        )

    def pending_logprobs(rid, out):
        if req.top_logprobs is None:
            return None
        entries, sent[rid] = (out.logprobs or [])[sent[rid] :], len(out.token_ids)
        return {"content": chat_logprobs(entries, ctx.token_text, req.top_logprobs)}

    try:
        for i in range(len(ids)):
            yield chunk(i, {"role": "assistant", "content": ""})
        while left:
            out = await queue.get()
            rid, i = out.request_id, index[out.request_id]
            held[rid] += out.new_text
            if plan.mode == "auto" and rid not in texting and held[rid] and not held[rid].startswith("<"):
                texting.add(rid)  # the grammar's text branch: no call can follow
            if rid in texting:
                text, held[rid] = held[rid], ""
                logprobs = pending_logprobs(rid, out)
                if text or logprobs and logprobs["content"]:
                    yield chunk(i, {"content": text}, logprobs=logprobs)
            if not out.finished:
                continue
            left.discard(rid)
            completion += len(out.token_ids)
            reason = out.finish_reason
            if rid not in texting:  # held: a tool call, or text that could not be told apart until the end
                content, calls = parse_output(plan, out.text, cut=reason == "length")
                logprobs = pending_logprobs(rid, out)
                reason = _finish_reason(reason, calls)
                if calls:
                    yield chunk(i, {"tool_calls": [dict(calls[0], index=0)]}, logprobs=logprobs)
                elif content or logprobs:
                    yield chunk(i, {"content": content}, logprobs=logprobs)
            yield chunk(i, {}, reason)
        if req.common.include_usage:
            yield sse(dict(head, choices=[], usage=usage(prompt_tokens, completion)))
        yield "data: [DONE]\n\n"
    finally:
        ctx.thread.abort([rid for rid in ids if rid in left])


def _finish_reason(engine_reason: str, calls: list[dict] | None) -> str:
    """ "tool_calls" for a complete call; a call the length limit cut keeps "length" (one whose JSON Schema check
    failed keeps "check_failed"), so a client never runs it."""
    return "tool_calls" if calls and engine_reason not in ("length", "check_failed", "dead_end") else engine_reason
