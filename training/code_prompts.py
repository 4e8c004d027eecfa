"""Chat-style programming requests for self-distillation, written offline (the target answers them later).

Two sources, beside `prompts.py`'s stubs and stdlib API requests:

* ``code-chat``   - "write a program / function / query / page that ..." requests in many languages, built from
  a task list written for this project, phrased several ways (the shape of MT-Bench's coding turns, none of its
  content: the tasks that MT-Bench and HumanEval ask are left out, and `drop_humaneval_named` drops any task that
  names a HumanEval function)
* ``code-review`` - real functions (their whole source, parsed with `ast` from the stdlib and installed packages,
  never imported: `source_functions`, which `prompts.py`'s stubs walk too) with a request about them: explain,
  review, test, rewrite in another language, ...

Both are deterministic for a seed; `prompts.build_prompts` mixes them in (`n_code_chat`, `n_code_review`).
"""

from __future__ import annotations

import ast
import itertools
import random
import re
import textwrap
from pathlib import Path
from typing import Iterable, Iterator

# ------------------------------------------------------------------------------------------------ code-chat

# Each task reads after "to": "Write a Go program to {task}." Generic exercises of everyday programming.
TASKS = (
    # strings and text
    "reverse the words of a sentence while keeping punctuation in place",
    "count how often each character occurs in a string and print the counts sorted by frequency",
    "convert a string from snake_case to camelCase",
    "convert a camelCase identifier to kebab-case",
    "remove duplicate characters from a string while keeping the first occurrence of each",
    "wrap a long paragraph of text at a given line width without breaking words",
    "compress a string with run-length encoding and decode it again",
    "check whether two strings are rotations of each other",
    "find the longest word in a sentence",
    "capitalize the first letter of every word in a title",
    "strip HTML tags from a string",
    "validate an email address with a regular expression",
    "extract every URL from a block of text",
    "mask all but the last four digits of a credit card number",
    "generate a random password with letters, digits and symbols",
    "count the words, lines and characters of a text file",
    "implement a simple Caesar cipher that encrypts and decrypts text",
    "find all positions of a substring inside a larger string",
    "truncate a string to a maximum length and add an ellipsis",
    "slugify a blog post title for use in a URL",
    "parse a query string such as a=1&b=two into a dictionary",
    "format a number of bytes as a human-readable size like 1.5 MB",
    "convert a Roman numeral to an integer",
    "convert an integer to its English words, such as 123 to one hundred twenty-three",
    "check whether a string is a valid IPv4 address",
    "split a CSV line correctly when fields contain quoted commas",
    "count the syllables in an English word with a simple heuristic",
    "build a word-frequency histogram of a paragraph and print it as stars",
    # arrays and numbers
    "rotate an array to the right by k positions in place",
    "move all zeros in an array to the end while keeping the order of the other elements",
    "find the two numbers in an array that add up to a target value",
    "find the maximum sum of a contiguous subarray",
    "merge overlapping intervals in a list of intervals",
    "remove duplicates from a sorted array in place and return the new length",
    "find the missing number in an array containing the numbers 1 to n with one missing",
    "compute a moving average over a list of numbers with a given window size",
    "flatten an arbitrarily nested list",
    "split a list into chunks of a given size",
    "transpose a matrix",
    "multiply two matrices",
    "rotate a square matrix by 90 degrees",
    "print a matrix in spiral order",
    "find the second largest number in a list without sorting it",
    "compute the mean, variance and standard deviation of a list of numbers",
    "convert a decimal number to binary, octal and hexadecimal",
    "compute the power of a number by repeated squaring",
    "compute the square root of a number with Newton's method",
    "round a floating point number to a given number of significant figures",
    "generate all permutations of a list",
    "generate all subsets of a set",
    "generate all combinations of k elements from a list",
    "find the longest increasing subsequence of an array",
    "find the pair of points closest to each other in a list of 2D points",
    "shuffle a list with the Fisher-Yates algorithm",
    "pick a random element from a list with weighted probabilities",
    "find the mode of a list of numbers",
    "simulate rolling two dice a thousand times and print the distribution of the sums",
    "estimate pi with a Monte Carlo simulation",
    "compute compound interest for a given principal, rate and number of years",
    "compute the area and perimeter of different shapes with a common interface",
    # data structures
    "implement a stack with push, pop and peek operations",
    "implement a queue using two stacks",
    "implement a circular buffer of fixed capacity",
    "implement a singly linked list with insert, delete and search",
    "reverse a singly linked list",
    "detect a cycle in a linked list",
    "merge two sorted linked lists into one sorted list",
    "implement a doubly linked list",
    "implement a binary search tree with insert, search and in-order traversal",
    "check whether a binary tree is balanced",
    "compute the height of a binary tree",
    "print a binary tree level by level",
    "serialize a binary tree to a string and deserialize it back",
    "implement a min-heap with insert and extract-min",
    "implement a priority queue for tasks with priorities",
    "implement a hash map with separate chaining",
    "implement an LRU cache with get and put in constant time",
    "implement a trie that supports insert and prefix search",
    "implement a disjoint-set (union-find) structure with path compression",
    "implement a graph as an adjacency list with functions to add edges and list neighbours",
    "implement a bit set that stores booleans compactly",
    "implement a simple matrix class with addition and multiplication",
    "implement a deque with operations at both ends",
    "implement a sparse vector that stores only non-zero entries",
    # algorithms
    "sort a list with merge sort",
    "sort a list with quicksort",
    "sort a list with heap sort",
    "sort an array of integers with counting sort",
    "perform a binary search on a sorted array",
    "find the first and last position of a value in a sorted array",
    "traverse a graph breadth-first from a start node",
    "traverse a graph depth-first and detect whether it has a cycle",
    "find the shortest path in a weighted graph with Dijkstra's algorithm",
    "compute a topological order of a directed acyclic graph",
    "count the connected components of an undirected graph",
    "find a minimum spanning tree with Kruskal's algorithm",
    "solve the 0/1 knapsack problem with dynamic programming",
    "compute the edit distance between two strings",
    "count the ways to climb a staircase taking one or two steps at a time",
    "find the minimum number of coins that make a given amount",
    "solve the N-queens problem and print one solution",
    "solve a Sudoku puzzle with backtracking",
    "find the shortest path through a grid maze from start to exit",
    "flood-fill a region of a 2D grid",
    "count the islands in a grid of land and water cells",
    "evaluate an arithmetic expression given as a string, with operator precedence",
    "convert an infix expression to postfix notation",
    "implement the sieve of Eratosthenes and list the primes below n",
    "play a game of tic-tac-toe between two players in the terminal",
    "simulate Conway's Game of Life on a small grid",
    "schedule jobs to maximize the number that finish before their deadlines",
    "find all anagram groups in a list of words",
    # files, data and systems
    "read a CSV file and compute the average of one of its columns",
    "read a JSON file, update one field and write it back safely",
    "merge several CSV files with the same header into one",
    "find the largest files under a directory",
    "rename every file in a folder by adding a date prefix",
    "watch a log file and print new lines as they are written",
    "count the lines of code in every source file of a project",
    "compute the SHA-256 checksum of a file",
    "copy a file while showing a progress percentage",
    "parse command-line arguments with flags and a help message",
    "read a configuration file in INI format and print its sections",
    "write a small key-value store that persists to disk",
    "download a web page and count the links on it",
    "run a simple HTTP server that answers with the current time",
    "make concurrent HTTP requests and report how long each took",
    "implement a thread-safe counter used by several threads",
    "implement a producer-consumer queue with threads",
    "retry a failing operation with exponential backoff",
    "rate-limit function calls to at most N per second",
    "cache the results of an expensive function call (memoization)",
    "measure how long a function takes to run",
    "parse dates in several formats and print them in ISO 8601",
    "compute the number of business days between two dates",
    "print a calendar for a given month and year",
    "convert a time between time zones",
    "validate a password against a set of rules and list the rules it breaks",
    "implement a simple bank account class with deposits, withdrawals and a balance check",
    "model a library system with books, members and loans",
    "implement a to-do list application that runs in the terminal",
    "implement a simple text-based adventure game with a few rooms",
    "write unit tests for a function that adds two numbers",
    "log messages to a file with timestamps and log levels",
    "generate a random maze and print it as text",
    "convert a table of data into a Markdown table",
    "implement a tiny template engine that replaces {name} placeholders",
    "tokenize a simple programming language into numbers, names and operators",
)

LANGUAGES = ("Python", "Python", "Python", "C++", "C++", "Java", "JavaScript", "TypeScript", "C", "Go", "Rust",
             "C#", "Ruby", "PHP", "Kotlin", "Swift")
SCRIPT_TASKS = (
    "back up a directory into a dated archive",
    "find and delete files older than 30 days in a folder",
    "print the ten largest files under the current directory",
    "check whether a website is up and print its status code",
    "count how many times each IP address appears in a web server log",
    "rename all .jpeg files in a folder to .jpg",
    "monitor disk usage and warn when it passes 90 percent",
    "loop over the lines of a file and print the ones that match a pattern",
)
TASK_TEMPLATES = (
    "Write a {lang} program to {task}.",
    "Write a function in {lang} to {task}.",
    "Implement a {lang} function that can {task}, and explain how it works.",
    "How do I {task} in {lang}? Show the code.",
    "Can you write {lang} code that will {task}? Include a short example of using it.",
    "Create a {lang} class or module to {task}, with comments.",
    "Give me a {lang} solution to {task}, and state its time and space complexity.",
    "I'm learning {lang}. Could you show me how to {task}?",
)
WEB_TASKS = (
    "shows a digital clock that updates every second",
    "has a form that checks an email address before it is submitted",
    "keeps a to-do list where items can be added, ticked off and removed",
    "switches between a light and a dark theme with a button",
    "counts down to a date the user picks",
    "shows a gallery of images with next and previous buttons",
    "converts temperatures between Celsius and Fahrenheit as the user types",
    "shows a navigation bar that collapses into a menu on small screens",
    "draws a bar chart from an array of numbers on a canvas",
    "lets the user play rock, paper, scissors against the computer",
    "shows a modal dialog when a button is clicked and closes it with Escape",
    "fetches JSON from a URL and lists the items in a table",
    "has a simple calculator with buttons for digits and operators",
    "shows a progress bar that fills up over five seconds",
    "counts the characters typed into a text area and warns past 280",
    "displays a pricing table with three plans side by side",
    "has tabs that show a different panel of content each",
    "plays a memory card-matching game",
    "stores a note in local storage and shows it again after a reload",
    "shows a star rating widget the user can click",
)
WEB_TEMPLATES = (
    "Write a simple web page in HTML, CSS and JavaScript that {task}.",
    "Create an HTML page with JavaScript that {task}.",
    "Build a small single-page app in plain JavaScript that {task}. Keep it in one HTML file.",
)
SQL_TASKS = (
    "list the five customers who spent the most, from tables customers(id, name) and orders(id, customer_id, total)",
    "find employees who earn more than their manager, from a table employees(id, name, salary, manager_id)",
    "count the orders per month in 2023 from a table orders(id, created_at, total)",
    "find duplicate email addresses in a table users(id, email)",
    "compute each product's share of total sales from a table sales(product, amount)",
    "list the students who took every course, from tables students, courses and enrollments",
    "find the second highest salary in a table employees(id, salary)",
    "get the latest order of every customer from a table orders(id, customer_id, created_at)",
    "compute a running total of sales by date from a table sales(day, amount)",
    "delete all but the newest row for every user from a table sessions(id, user_id, started_at)",
    "find the departments with no employees, from tables departments(id, name) and employees(id, department_id)",
    "rank products by revenue within each category from a table products(id, category, revenue)",
)
SQL_TEMPLATES = (
    "Write an SQL query to {task}.",
    "How would you {task} in SQL? Explain the query.",
)

# Requests close to the evaluation sets' tasks (MT-Bench's coding questions, common HumanEval functions) are left out
# of the lists above by hand; these words would bring them back and are checked for in the tests.
HELD_OUT_THEMES = ("fibonacci", "majority element", "median of two", "common ancestor", "longest common subsequence",
                   "top-5 words", "random joke", "full binary tree", "kth smallest", "common elements",
                   "palindrome", "is prime", "fizzbuzz", "bracket", "parenthes", "vowel", "factorial")


def _words(text: str) -> str:
    return " " + " ".join(re.findall(r"[a-z0-9]+", text.casefold())) + " "


def drop_humaneval_named(texts: Iterable[str], entry_points: Iterable[str]) -> list[str]:
    """Texts that name no HumanEval function: "check whether a number is prime" names `is_prime`. A name of two or more
    words (split at underscores) counts when they appear together; one-word names ("search", "multiply") are too
    common to tell a task by."""
    needles = []
    for name in entry_points:
        parts = [p for p in name.casefold().split("_") if p]
        if len(parts) > 1:
            needles.append(" " + " ".join(parts) + " ")
    return [t for t in texts if not any(n in _words(t) for n in needles)]


def code_chat_candidates(seed: int = 0, exclude_names: Iterable[str] = ()) -> list[str]:
    """Every task in every language, under two different templates per time the language is listed in LANGUAGES
    (chosen per task and language, stable for a seed: Python six, C++ four, the others two), the shell, web and SQL
    requests likewise; tasks naming a HumanEval function (`exclude_names`) left out."""
    names = list(exclude_names)
    prompts = []
    for task, lang in itertools.product(drop_humaneval_named(TASKS, names), dict.fromkeys(LANGUAGES)):
        rng = random.Random(f"{seed}:code-chat:{lang}:{task}")
        for template in rng.sample(TASK_TEMPLATES, 2 * LANGUAGES.count(lang)):
            prompts.append(template.format(lang=lang, task=task))
    for task, lang in itertools.product(SCRIPT_TASKS, ("Bash", "PowerShell", "Python")):
        rng = random.Random(f"{seed}:code-chat:{lang}:{task}")
        prompts.append(rng.choice(TASK_TEMPLATES[:5]).format(lang=f"{lang} script" if lang != "Python" else lang,
                                                             task=task))
    for task, template in itertools.product(WEB_TASKS, WEB_TEMPLATES):
        prompts.append(template.format(task=task))
    for task, template in itertools.product(SQL_TASKS, SQL_TEMPLATES):
        prompts.append(template.format(task=task))
    return prompts


# ---------------------------------------------------------------------------------------------- code-review

REVIEW_TEMPLATES = (
    "Explain what this Python function does, step by step.\n\n```python\n{code}```",
    "Review this Python function and point out any bugs or edge cases it gets wrong.\n\n```python\n{code}```",
    "Write pytest unit tests for this function.\n\n```python\n{code}```",
    "Rewrite this Python function in {lang}.\n\n```python\n{code}```",
    "Add type hints and a clear docstring to this function.\n\n```python\n{code}```",
    "How could this function be made faster or more readable? Show the improved version.\n\n```python\n{code}```",
    "What is the time complexity of this function? Explain.\n\n```python\n{code}```",
    "```python\n{code}```\n\nWhat does this code do, and when would I use it?",
)
REVIEW_LANGUAGES = ("JavaScript", "C++", "Java", "Go", "Rust", "TypeScript")
REVIEW_MIN_CHARS, REVIEW_MAX_CHARS = 200, 1500
REVIEW_MIN_LINES, REVIEW_MAX_LINES = 5, 40


def source_functions(roots: Iterable[Path], skipped_parts: Iterable[str] = ()) -> Iterator[tuple]:
    """(function node, its class name or None, the file's lines) for every function and method (of a public class)
    defined at the top of a module under `roots`, files in sorted order, none under a folder named in
    `skipped_parts`; files are parsed with `ast`, never imported, and the ones that do not parse are passed over."""
    skipped = frozenset(skipped_parts)
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if skipped.intersection(path.relative_to(root).parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text)
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            lines = text.splitlines(keepends=True)
            scopes = [(tree, None)] + [(node, node.name) for node in tree.body
                                       if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]
            for scope, class_name in scopes:
                for node in scope.body:
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        yield node, class_name, lines


def function_sources(roots: Iterable[Path], exclude_names: Iterable[str] = (),
                     skipped_parts: Iterable[str] = ()) -> list[str]:
    """The whole source (dedented, docstring kept) of public functions and methods of 5-40 lines and 200-1500
    characters under the given roots (`source_functions`), in a deterministic order, without repeats."""
    excluded = set(exclude_names)
    sources = []
    for node, _, lines in source_functions(roots, skipped_parts):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in excluded:
            continue
        count = node.end_lineno - node.lineno + 1
        if node.decorator_list or not REVIEW_MIN_LINES <= count <= REVIEW_MAX_LINES:
            continue
        # whole lines (ast.get_source_segment re-splits the file on every call: minutes for torch)
        code = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno])).rstrip() + "\n"
        if REVIEW_MIN_CHARS <= len(code) <= REVIEW_MAX_CHARS and "```" not in code:
            sources.append(code)
    return list(dict.fromkeys(sources))  # the first of repeats, in order


def code_review_candidates(roots: Iterable[Path], seed: int = 0, exclude_names: Iterable[str] = (),
                           skipped_parts: Iterable[str] = ()) -> list[str]:
    """Each function's source under `roots` (`function_sources`) under one review request (chosen per function,
    stable for a seed)."""
    prompts = []
    for code in function_sources(roots, exclude_names, skipped_parts):
        rng = random.Random(f"{seed}:code-review:{code}")
        prompts.append(rng.choice(REVIEW_TEMPLATES).format(code=code, lang=rng.choice(REVIEW_LANGUAGES)))
    return prompts
