"""An agent-style fan-out: each question goes to a panel of expert personas in parallel
(LCEL ``RunnableParallel``), then a moderator call gathers their answers.

Every branch is its own ``ChatMLXParallm`` call; LangChain runs them concurrently and the
shared engine decodes them together, so the panel costs about one call's wall time
instead of one per expert. The decode batch size comes from ``engine.stats()``.

Run: python examples/agent_fanout.py [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableParallel, RunnablePassthrough

from mlx_parallm_provider import get_engine, shutdown_engines
from mlx_parallm_provider.langchain import ChatMLXParallm

EXPERTS = ["historian", "chef", "engineer", "doctor", "poet", "economist", "teacher", "biologist"]
QUESTIONS = ["Why do people drink coffee?", "Why is bread so common?", "Why do cities have parks?", "Why do we sleep?"]


def expert_panel(chat: ChatMLXParallm) -> RunnableParallel:
    """One branch per expert: the same question, a different system persona."""
    branches = {}
    for expert in EXPERTS:
        prompt = ChatPromptTemplate.from_messages(
            [("system", f"You are a {expert}. Answer in one sentence."), ("user", "{question}")]
        )
        branches[expert] = prompt | chat | StrOutputParser()
    return RunnableParallel(branches)


def moderator(chat: ChatMLXParallm):
    """Gathers the panel's answers into one reply."""
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "You summarise a panel discussion in two sentences."),
            ("user", "Question: {question}\n\nPanel answers:\n{answers}"),
        ]
    )
    return prompt | chat | StrOutputParser()


def format_answers(state: dict) -> str:
    return "\n".join(f"- {expert}: {state['panel'][expert].strip()}" for expert in EXPERTS)


async def main(max_tokens: int) -> None:
    chat = ChatMLXParallm(model="default", max_tokens=max_tokens)
    engine = get_engine("default")
    flow = (
        RunnablePassthrough.assign(panel=expert_panel(chat))  # fan out: one call per expert
        | RunnablePassthrough.assign(answers=format_answers)
        | RunnablePassthrough.assign(summary=moderator(chat))  # gather
    )
    tic = time.perf_counter()
    results = await flow.abatch([{"question": q} for q in QUESTIONS])
    elapsed = time.perf_counter() - tic

    first = results[0]
    print(f"Q: {first['question']}")
    for expert in EXPERTS[:3]:
        print(f"  {expert:>9}: {first['panel'][expert].strip()}")
    print(f"  moderator: {first['summary'].strip()}")
    stats = engine.stats()
    calls = len(QUESTIONS) * (len(EXPERTS) + 1)
    print(f"{calls} calls ({len(QUESTIONS)} questions x {len(EXPERTS)} experts + {len(QUESTIONS)} moderators) in {elapsed:.1f} s")
    print(f"max decode batch: {stats['max_batch_size']}, requests finished: {stats['finished']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    try:
        asyncio.run(main(args.max_tokens))
    finally:
        shutdown_engines()
