"""A scripted engine behind the whole HTTP app, in process: it "generates" a known text for every request, so a test
knows exactly what the model wrote and checks what each API (through the official client) makes of it."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import openai

from surge.engine.args import EngineArgs
from surge.engine.input_processor import InputProcessor, load_tokenizer
from surge.entrypoints.openai.app import build_app
from surge.entrypoints.openai.options import ServerOptions
from surge.outputs import CompletionOutput, RequestOutput


class ScriptedEngine:
    """Answers every request with `text`, streamed one output a piece: the tokenizer's own tokens (piece_chars None:
    usage counts real tokens; each piece the text its token adds), or pieces of piece_chars characters, each one
    token 7; not streamed, `text` and all the pieces' tokens. Records the prompts."""

    def __init__(self, model_dir, text: str, max_model_len: int, piece_chars: int | None = None) -> None:
        self.config = EngineArgs(model_dir, device="cpu", max_model_len=max_model_len).create_engine_config()
        self.tokenizer = load_tokenizer(model_dir)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.dead_error, self.is_running = None, True
        self.prompts: list[list[int]] = []
        self.text = text
        if piece_chars is None:
            ids, decode = self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.decode
            self.pieces = [(decode(ids[:i + 1])[len(decode(ids[:i])):], [t]) for i, t in enumerate(ids)]
        else:
            self.pieces = [(text[i:i + piece_chars], [7]) for i in range(0, len(text), piece_chars)]
        self.ids = [t for _, piece_ids in self.pieces for t in piece_ids]

    def _outputs(self, request_id: str, token_ids: list[int]) -> list[RequestOutput]:
        last = len(self.pieces) - 1
        return [RequestOutput(request_id, None, token_ids, [CompletionOutput(
            0, text, ids, finish_reason="stop" if i == last else None)], finished=i == last)
            for i, (text, ids) in enumerate(self.pieces)]

    async def add_request(self, request_id, prompt, params, output_kind, pooling_params=None, lora_request=None):
        self.prompts.append(prompt["prompt_token_ids"])
        queue: asyncio.Queue = asyncio.Queue()
        for out in self._outputs(request_id, prompt["prompt_token_ids"]):
            queue.put_nowait(out)
        return queue

    async def generate(self, prompt, params, request_id, output_kind, pooling_params=None, lora_request=None):
        self.prompts.append(prompt["prompt_token_ids"])
        yield RequestOutput(request_id, None, prompt["prompt_token_ids"], [CompletionOutput(
            0, self.text, list(self.ids), finish_reason="stop")], finished=True)

    async def abort(self, request_id) -> None:
        pass

    def prompt_text(self, i: int) -> str:
        return self.tokenizer.decode(self.prompts[i])


def serve(engine: ScriptedEngine, options: ServerOptions | None,
          body: Callable[[openai.AsyncOpenAI], Awaitable], timeout_s: float = 120):
    """body(client) against the app over the engine, in process (ASGI, no socket): what it returns."""
    app = build_app(engine, ["m"], options=options)

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        try:
            return await body(client)
        finally:
            await http.aclose()

    return asyncio.run(asyncio.wait_for(main(), timeout_s))
