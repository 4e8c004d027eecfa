"""Generated problems: math word problems (GSM8K-style: a short story with quantities and a few steps of arithmetic)
and logic puzzles, from templates written for this project. The target answers them step by step later.

Two disjoint sets of word-problem templates: TRAIN_TEMPLATES make training prompts (`word_problems`), EVAL_TEMPLATES
make the `math` evaluation task (`eval_word_problems`: other scenarios, other seed), so the evaluation measures the
drafter on problems it has never seen the shape of. The evaluation set's own scenarios (MT-Bench's math turns: a bus
and its stops, copies bought in a bookstore, an investment halved the next year) are in neither list
(`HELD_OUT_THEMES`, checked by the tests).

Every template is a function of a `Draw` (one problem's random choices) returning the problem's text; a problem is
deterministic for (seed, template, index).
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

SHE = ("Aisha", "Maria", "Chloe", "Priya", "Sofia", "Hannah", "Mei", "Fatima", "Olivia", "Lucia", "Grace", "Yuki",
       "Nadia", "Emma", "Zara", "Ingrid", "Leila", "Rosa", "Anika", "Julia", "Keiko", "Tara", "Elena", "Amara")
HE = ("Omar", "Liam", "Kenji", "Carlos", "Ravi", "Noah", "Ethan", "Mateo", "Ibrahim", "Lucas", "Jonas", "Kwame",
      "Diego", "Arjun", "Felix", "Hiro", "Samuel", "Marco", "Tomas", "Yusuf", "Oscar", "Leon", "Andre", "Wei")
NAMES = SHE + HE
INSTRUCTIONS = ("Solve it step by step and give the final answer.", "Show your reasoning step by step.",
                "Explain each step, then state the answer.", "Work it out step by step.",
                "Think it through step by step before answering.")
EVAL_INSTRUCTION = INSTRUCTIONS[0]
EVAL_SEED = "math-eval"
EVAL_PROMPTS = 80
HELD_OUT_THEMES = ("bus stop", "bookstore", "copies of", "software development", "invests", "got on", "got off")


@dataclass(frozen=True)
class Person:
    name: str
    he: str
    his: str
    him: str


class Draw:
    """One problem's random choices: people (no name twice), whole numbers, options."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def person(self) -> Person:
        name = self.rng.choice([n for n in NAMES if n not in self.used])
        self.used.add(name)
        return Person(name, "she", "her", "her") if name in SHE else Person(name, "he", "his", "him")

    def num(self, low: int, high: int, step: int = 1) -> int:
        return self.rng.randrange(low, high + 1, step)

    def pick(self, options):
        return self.rng.choice(options)


# (singular, plural, lowest and highest whole-dollar price)
GOODS = (("notebook", "notebooks", 2, 6), ("pen", "pens", 1, 3), ("mug", "mugs", 5, 12), ("candle", "candles", 3, 9),
         ("towel", "towels", 6, 15), ("plant pot", "plant pots", 4, 10), ("puzzle", "puzzles", 8, 20),
         ("scarf", "scarves", 9, 25), ("lamp", "lamps", 15, 40), ("bottle of juice", "bottles of juice", 2, 5),
         ("bag of rice", "bags of rice", 3, 8), ("pair of socks", "pairs of socks", 2, 7),
         ("cushion", "cushions", 7, 18))
SNACKS = (("cookies", "muffins"), ("lemonade cups", "brownies"), ("cupcakes", "slices of pie"), ("bagels", "smoothies"))
CHORES = ("paint a fence", "clean the garage", "weed the garden", "wash all the windows", "sort the warehouse shelves")
CROPS = ("tomatoes", "peppers", "carrots", "cucumbers", "strawberries")


def money(cents: int) -> str:
    return f"${cents // 100}" if cents % 100 == 0 else f"${cents // 100}.{cents % 100:02d}"


def clock(minutes: int) -> str:
    hours, minutes = divmod(minutes % (24 * 60), 60)
    return f"{(hours - 1) % 12 + 1}:{minutes:02d} {'a.m.' if hours < 12 else 'p.m.'}"


# ------------------------------------------------------------------------------------------- training templates

def shopping_change(d: Draw) -> str:
    p, (a, b) = d.person(), d.rng.sample(GOODS, 2)
    na, nb, pa, pb = d.num(2, 6), d.num(2, 5), d.num(a[2], a[3]), d.num(b[2], b[3])
    paid = next(x for x in (20, 50, 100, 200, 500) if x > na * pa + nb * pb)
    return (f"{p.name} buys {na} {a[1]} at ${pa} each and {nb} {b[1]} at ${pb} each. {p.he.capitalize()} hands the "
            f"cashier ${paid}. How much change does {p.he} get?")


def discount(d: Draw) -> str:
    p, item = d.person(), d.pick(GOODS)
    price, off, n = 4 * d.num(item[2], item[3]), d.pick((10, 20, 25, 40, 50)), d.num(2, 6)
    return (f"A shop sells {item[1]} for ${price} each. This week everything is {off}% off. {p.name} buys {n} "
            f"{item[1]}. How much does {p.he} pay in total?")


def distance_rate(d: Draw) -> str:
    p, speed, hours, more = d.person(), d.num(6, 18) * 5, d.num(2, 4), d.num(3, 7)
    unit = d.pick(("kilometers", "miles"))
    return (f"{p.name} drives {speed * hours} {unit} in {hours} hours at a steady speed. At the same speed, how far "
            f"does {p.he} drive in {more} hours?")


def work_together(d: Draw) -> str:
    p, q, chore = d.person(), d.person(), d.pick(CHORES)
    a, b = d.pick(((3, 6), (4, 12), (6, 12), (10, 15), (12, 24), (20, 30), (6, 3), (15, 10)))
    return (f"{p.name} can {chore} alone in {a} hours. {q.name} can do the same job alone in {b} hours. How long "
            f"does it take them working together?")


def ages_sum(d: Draw) -> str:
    p, q, r = d.person(), d.person(), d.person()
    youngest, gap, times = d.num(3, 12), d.num(2, 9), d.pick((2, 3))
    return (f"{r.name} is {youngest} years old. {q.name} is {times} times as old as {r.name}, and {p.name} is "
            f"{gap} years older than {q.name}. What is the sum of their three ages?")


def ages_twice(d: Draw) -> str:
    p, q = d.person(), d.person()
    gap = d.num(12, 30)
    age = d.num(gap + 1, 2 * gap - 1)
    return (f"{p.name} is {age} years old and {q.name} is {age - gap}. In how many years will {p.name} be exactly "
            f"twice as old as {q.name}?")


def fraction_left(d: Draw) -> str:
    p, k, m = d.person(), d.pick((2, 3, 4, 5)), d.pick((2, 3, 4))
    total = k * m * d.num(4, 20)
    return (f"{p.name} has ${total}. {p.he.capitalize()} spends 1/{k} of it on a concert ticket and then 1/{m} of "
            f"what is left on dinner. How much money does {p.he} have left?")


def percent_growth(d: Draw) -> str:
    item, last, pct = d.pick(GOODS), d.num(4, 30) * 20, d.pick((5, 10, 15, 20, 25, 30, 45))
    return (f"A store sold {last} {item[1]} last month. This month it sold {pct}% more than last month. How many "
            f"{item[1]} did it sell in the two months together?")


def savings_weeks(d: Draw) -> str:
    p, item = d.person(), d.pick(("bicycle", "tablet", "guitar", "telescope", "pair of skates", "camera"))
    weekly, have, weeks = d.num(3, 15) * 2, d.num(1, 10) * 5, d.num(4, 20)
    return (f"{p.name} wants a {item} that costs ${have + weekly * weeks}. {p.he.capitalize()} already has ${have} "
            f"and saves ${weekly} every week. How many weeks will it take {p.him} to afford the {item}?")


def recipe_scaling(d: Draw) -> str:
    serves, cups = d.pick(((4, 3), (6, 4), (8, 6), (3, 2), (5, 2))), d.pick(("cups of flour", "eggs", "cups of milk"))
    servings, amount = serves
    want = servings * d.num(2, 5)
    return (f"A recipe for {servings} servings uses {amount} {cups}. How many {cups} are needed to make {want} "
            f"servings?")


def overtime_pay(d: Draw) -> str:
    p, wage, hours = d.person(), d.num(6, 20) * 2, d.num(42, 55)
    return (f"{p.name} earns ${wage} an hour for the first 40 hours of a week and one and a half times that rate for "
            f"every hour over 40. Last week {p.he} worked {hours} hours. How much did {p.he} earn?")


def fence_cost(d: Draw) -> str:
    length, width, price = d.num(6, 30), d.num(4, 20), d.num(3, 15)
    return (f"A rectangular garden is {length} meters long and {width} meters wide. Fencing costs ${price} per meter. "
            f"How much does it cost to put a fence around the whole garden?")


def tile_boxes(d: Draw) -> str:
    length, width, per_box = d.num(3, 8), d.num(3, 6), d.pick((8, 10, 12, 20))
    return (f"A room is {length} meters by {width} meters. The floor is covered with square tiles of 50 centimeters "
            f"on a side, sold in boxes of {per_box}. How many boxes are needed?")


def train_arrival(d: Draw) -> str:
    start, speed, hours = d.num(5 * 60, 14 * 60, 15), d.num(6, 16) * 10, d.pick((1.5, 2, 2.5, 3, 4))
    return (f"A train leaves at {clock(start)} and travels {int(speed * hours)} kilometers at an average speed of "
            f"{speed} kilometers per hour. At what time does it arrive?")


def fuel_cost(d: Draw) -> str:
    p, per_100, km, price = d.person(), d.num(5, 9), d.num(2, 12) * 100, d.pick((150, 175, 180, 200, 125))
    return (f"{p.name}'s car uses {per_100} liters of fuel per 100 kilometers. {p.he.capitalize()} drives {km} "
            f"kilometers, and fuel costs {money(price)} per liter. How much does the fuel for the trip cost?")


def average_needed(d: Draw) -> str:
    p, scores = d.person(), [d.num(60, 95) for _ in range(3)]
    target = (sum(scores) + d.num(70, 100)) // 4
    return (f"{p.name} scored {scores[0]}, {scores[1]} and {scores[2]} on three tests. What score does {p.he} need "
            f"on the fourth test to have an average of {target}?")


def ratio_split(d: Draw) -> str:
    p, q = d.person(), d.person()
    a, b = d.pick(((2, 3), (3, 5), (1, 4), (4, 5), (2, 7)))
    total = (a + b) * d.num(5, 40) * 10
    return (f"{p.name} and {q.name} share a prize of ${total} in the ratio {a}:{b}. How much more does {q.name} get "
            f"than {p.name}?")


def boxes_left_over(d: Draw) -> str:
    rate, hours, box = d.num(40, 200), d.num(3, 9), d.pick((6, 12, 24, 25, 30))
    thing = d.pick(("jars of jam", "toy cars", "light bulbs", "water bottles"))
    return (f"A factory makes {rate} {thing} an hour for {hours} hours. They are packed in boxes of {box}. How many "
            f"boxes are filled, and how many {thing} are left over?")


def tank_fill(d: Draw) -> str:
    inflow, leak = d.num(12, 40), d.num(2, 10)
    volume = (inflow - leak) * d.num(10, 60)
    return (f"A water tank holds {volume} liters. A hose fills it at {inflow} liters per minute, but a crack lets "
            f"{leak} liters per minute leak out. Starting empty, how many minutes does it take to fill the tank?")


def garden_harvest(d: Draw) -> str:
    p, crop = d.person(), d.pick(CROPS)
    rows, plants, each, bag, price = d.num(3, 8), d.num(5, 12), d.num(4, 10), d.pick((5, 10, 12)), d.num(2, 6)
    return (f"{p.name} grows {crop} in {rows} rows of {plants} plants. Each plant gives {each} {crop}. "
            f"{p.he.capitalize()} sells them in bags of {bag} for ${price} a bag. How much money does {p.he} make from "
            f"the full bags?")


def stickers_total(d: Draw) -> str:
    p, q, r = d.person(), d.person(), d.person()
    second, more = 2 * d.num(8, 40), d.num(4, 15)
    thing = d.pick(("stickers", "marbles", "trading cards", "seashells"))
    return (f"{p.name} has {second - more} {thing}. {q.name} has {more} more {thing} than {p.name}, and {r.name} has "
            f"half as many as {q.name}. How many {thing} do the three of them have altogether?")


def temperature_change(d: Draw) -> str:
    start, down, h1, up, h2 = d.num(-5, 25), d.num(1, 4), d.num(2, 6), d.num(1, 5), d.num(2, 5)
    return (f"At midnight the temperature is {start} degrees. It falls {down} degrees every hour for {h1} hours and "
            f"then rises {up} degrees every hour for {h2} hours. What is the temperature at the end?")


def bake_sale(d: Draw) -> str:
    (a, b), na, nb = d.pick(SNACKS), d.num(15, 60), d.num(10, 40)
    pa, pb, cost = d.pick((50, 75, 100, 125)), d.pick((150, 200, 250)), d.num(10, 40)
    return (f"At a school bake sale the class sells {na} {a} at {money(pa)} each and {nb} {b} at {money(pb)} each. "
            f"The ingredients cost ${cost}. What is the class's profit?")


def meeting_point(d: Draw) -> str:
    p, q = d.person(), d.person()
    v1, v2, hours = d.num(8, 20), d.num(8, 20), d.num(1, 4)
    return (f"{p.name} and {q.name} start {(v1 + v2) * hours} kilometers apart and cycle toward each other, "
            f"{p.name} at {v1} km/h and {q.name} at {v2} km/h. After how long do they meet, and how far has "
            f"{p.name} ridden?")


def class_percent(d: Draw) -> str:
    size, girls, play = d.pick((20, 40, 50, 60)), d.pick((40, 60, 80)), d.pick((25, 50, 75))
    sport = d.pick(("soccer", "chess", "the violin", "basketball"))
    return (f"A class has {size * 2} students. {girls}% of them are girls, and {play}% of the girls play {sport}. "
            f"How many girls in the class play {sport}?")


def rope_pieces(d: Draw) -> str:
    meters, piece = d.num(3, 25), d.pick((30, 40, 45, 60, 75, 80))
    return (f"A rope is {meters} meters long. It is cut into pieces of {piece} centimeters each. How many whole "
            f"pieces are there, and how many centimeters of rope are left?")


def simple_interest(d: Draw) -> str:
    p, principal, rate, years = d.person(), d.num(5, 50) * 100, d.pick((2, 3, 4, 5, 6)), d.num(2, 6)
    return (f"{p.name} puts ${principal} in a savings account that pays {rate}% simple interest per year. How much "
            f"is in the account after {years} years?")


def homework_schedule(d: Draw) -> str:
    p, subjects, each, rest = d.person(), d.num(3, 5), d.pick((20, 25, 30, 40, 45)), d.pick((5, 10, 15))
    start = d.num(15 * 60, 18 * 60, 15)
    return (f"{p.name} has {subjects} subjects of homework, {each} minutes each, with a {rest}-minute break between "
            f"two subjects. {p.he.capitalize()} starts at {clock(start)}. When does {p.he} finish?")


def bulk_savings(d: Draw) -> str:
    item, pack, single, n = d.pick(GOODS), d.pick((4, 6, 10)), d.num(2, 9), d.num(2, 5)
    pack_price = pack * single - d.num(1, pack)
    return (f"Single {item[1]} cost ${single} each, or a pack of {pack} costs ${pack_price}. How much is saved by "
            f"buying {n * pack} {item[1]} in packs instead of one at a time?")


TRAIN_TEMPLATES = (shopping_change, discount, distance_rate, work_together, ages_sum, ages_twice, fraction_left,
                   percent_growth, savings_weeks, recipe_scaling, overtime_pay, fence_cost, tile_boxes, train_arrival,
                   fuel_cost, average_needed, ratio_split, boxes_left_over, tank_fill, garden_harvest, stickers_total,
                   temperature_change, bake_sale, meeting_point, class_percent, rope_pieces, simple_interest,
                   homework_schedule, bulk_savings)


# ----------------------------------------------------------------------------------------- evaluation templates

def concert_tickets(d: Draw) -> str:
    p, adults, kids = d.person(), d.num(2, 4), d.num(2, 5)
    adult, child, fee = d.num(20, 60), d.num(8, 19), d.pick((3, 4, 5, 6))
    return (f"Concert tickets cost ${adult} for an adult and ${child} for a child, and every ticket has a ${fee} "
            f"service fee. {p.name} buys tickets for {adults} adults and {kids} children. What is the total cost?")


def print_job(d: Draw) -> str:
    per_minute, warm, jobs, minutes = d.num(10, 40), d.num(1, 4), d.num(2, 5), d.num(2, 10)
    return (f"An office printer prints {per_minute} pages per minute and needs {warm} minutes to warm up before each "
            f"job. How many minutes does it take to print {jobs} jobs of {per_minute * minutes} pages each?")


def orchard_sales(d: Draw) -> str:
    trees, kilos, price = d.num(10, 60), d.num(2, 9) * 4, d.num(2, 5)
    fruit = d.pick(("apples", "pears", "plums", "peaches"))
    return (f"An orchard has {trees} trees, and each tree gives {kilos} kilograms of {fruit}. A quarter of the harvest "
            f"is spoiled. The rest is sold at ${price} per kilogram. How much money does the orchard make?")


def parking_fees(d: Draw) -> str:
    p, first, extra, hours, days = d.person(), d.num(3, 8), d.num(1, 4), d.num(2, 9), d.num(3, 6)
    return (f"A parking garage charges ${first} for the first hour and ${extra} for each additional hour. {p.name} "
            f"parks there for {hours} hours a day on {days} days. How much does {p.he} pay in all?")


def elevator_load(d: Draw) -> str:
    limit, people, weight, box = d.num(8, 16) * 100, d.num(3, 8), d.num(65, 85), d.pick((15, 20, 25, 30))
    return (f"An elevator can carry at most {limit} kilograms. {people} people with an average weight of {weight} "
            f"kilograms get in. How many {box}-kilogram boxes can still be loaded?")


def training_plan(d: Draw) -> str:
    p, first, step, weeks = d.person(), d.num(5, 20), d.num(1, 5), d.num(4, 10)
    return (f"{p.name} runs {first} kilometers in the first week of training and {step} kilometers more each week "
            f"than the week before. How many kilometers does {p.he} run over {weeks} weeks?")


def aquarium_volume(d: Draw) -> str:
    length, width, height = d.num(4, 12) * 10, d.num(3, 6) * 10, d.num(2, 3) * 20
    return (f"A fish tank is {length} cm long, {width} cm wide and {height} cm high. It is filled to three quarters "
            f"of its height. How many liters of water are in it? (1 liter is 1,000 cubic centimeters.)")


def pizza_order(d: Draw) -> str:
    p, guests, slices, per_pizza, price = d.person(), d.num(6, 30), d.num(2, 4), d.pick((6, 8, 10)), d.num(9, 18)
    return (f"{p.name} is hosting {guests} guests, and each will eat {slices} slices of pizza. A pizza has "
            f"{per_pizza} slices and costs ${price}. How many pizzas must {p.he} order, and what do they cost?")


def battery_drain(d: Draw) -> str:
    start, stream, idle, h1, h2 = d.num(70, 100), d.num(8, 12), d.num(1, 3), d.num(2, 3), d.num(3, 6)
    return (f"A phone's battery is at {start}%. Streaming video uses {stream}% of the battery per hour, and standby "
            f"uses {idle}% per hour. After {h1} hours of streaming and {h2} hours on standby, what is the battery "
            f"level?")


def currency_exchange(d: Draw) -> str:
    p, dollars, rate = d.person(), d.num(4, 20) * 50, d.pick((4, 5, 8, 20))
    spent = d.num(1, dollars * rate // 100 - 1) * 100
    return (f"On a trip, {p.name} changes ${dollars} into the local currency at {rate} units per dollar and spends "
            f"{spent} units. At the end {p.he} changes the rest back at the same rate. How many dollars does {p.he} "
            f"get?")


def quiz_score(d: Draw) -> str:
    p, questions, points, penalty = d.person(), d.pick((20, 25, 40, 50)), d.pick((2, 4, 5)), d.pick((1, 2))
    right = d.num(questions // 2, questions - 1)
    return (f"A quiz has {questions} questions worth {points} points each, and {penalty} point{'s' * (penalty > 1)} "
            f"{'are' if penalty > 1 else 'is'} taken off for "
            f"every wrong answer. {p.name} answers every question and gets {right} right. What percentage of the "
            f"maximum score does {p.he} get?")


def painting_rooms(d: Draw) -> str:
    rooms, area, per_can, price = d.num(2, 6), d.num(30, 60), d.pick((25, 40, 50)), d.num(20, 45)
    return (f"Each of {rooms} rooms has {area} square meters of wall. Every wall needs two coats of paint, and "
            f"one can covers {per_can} square meters. Cans cost ${price}. How much is spent on paint?")


EVAL_TEMPLATES = (concert_tickets, print_job, orchard_sales, parking_fees, elevator_load, training_plan,
                  aquarium_volume, pizza_order, battery_drain, currency_exchange, quiz_score, painting_rooms)


# ---------------------------------------------------------------------------------------------- logic puzzles

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
COMPARISONS = (("taller than", "tallest", "shortest"), ("older than", "oldest", "youngest"),
               ("faster than", "fastest", "slowest"), ("heavier than", "heaviest", "lightest"))
OWNED = (("cat", "dog", "parrot", "rabbit"), ("red bike", "blue bike", "green bike", "yellow bike"),
         ("violin", "piano", "drum", "flute"), ("scooter", "skateboard", "kite", "sled"))
NONSENSE = ("blips", "zorts", "wugs", "drells", "fims", "plonks", "quads", "snerbs")
PUZZLE_INSTRUCTIONS = ("Explain your reasoning.", "Think it through step by step.", "Explain how you got the answer.",
                       "Give the answer and justify it.")


def ordering(d: Draw) -> str:
    people = [d.person().name for _ in range(d.num(3, 5))]  # people[0] has the most of the quality
    relation, most, least = d.pick(COMPARISONS)
    clues = [f"{a} is {relation} {b}." for a, b in zip(people, people[1:])]
    d.rng.shuffle(clues)
    question = d.pick((f"Who is the {most}?", f"Who is the {least}?", f"Order them from the {most} to the {least}."))
    return " ".join(clues) + " " + question


def weekday(d: Draw) -> str:
    day, n = d.pick(DAYS), d.num(3, 400)
    return d.pick((f"If today is {day}, what day of the week will it be {n} days from now?",
                   f"If today is {day}, what day of the week was it {n} days ago?",
                   f"If the day after tomorrow is {day}, what day of the week was it {n} days before yesterday?"))


def knights_and_knaves(d: Draw) -> str:
    """Islanders who say things about each other; only puzzles with exactly one answer are kept."""
    while True:
        names = [d.person().name for _ in range(d.num(2, 3))]
        claims = [d.pick([(s, o, kind) for o in range(len(names)) if o != s for kind in range(5)])
                  for s in range(len(names))]
        answers = [kinds for kinds in itertools.product((True, False), repeat=len(names))
                   if all(claim_holds(kinds, *c) == kinds[c[0]] for c in claims)]
        if len(answers) == 1:
            said = " ".join(f"{names[s]} says: \"{claim_text(names[o], kind)}\"" for s, o, kind in claims)
            return (f"On an island, knights always tell the truth and knaves always lie. You meet {', '.join(names)}. "
                    f"{said} Who is a knight and who is a knave?")
        d.used.clear()


def claim_holds(kinds, speaker: int, other: int, kind: int) -> bool:
    me, them = kinds[speaker], kinds[other]
    return (them, not them, me and them, me != them, not (me and them))[kind]


def claim_text(other: str, kind: int) -> str:
    return (f"{other} is a knight.", f"{other} is a knave.", f"{other} and I are both knights.",
            f"{other} and I are not the same kind.", f"At least one of {other} and I is a knave.")[kind]


def next_term(d: Draw) -> str:
    a, k = d.num(1, 12), d.num(2, 9)
    rule = d.pick((lambda i: a + k * i, lambda i: a * (2 + k % 2) ** i, lambda i: i * i + a,
                   lambda i: (i + 1) * (i + 2) + a, lambda i: a + k * (i // 2) + (i % 2) * 3,
                   lambda i: a + i * (i + 1) // 2 * k))
    terms = ", ".join(str(rule(i)) for i in range(d.num(4, 6)))
    return d.pick((f"What number comes next in the sequence {terms}, ...?",
                   f"Find the pattern in {terms} and give the next two numbers."))


def clock_angle(d: Draw) -> str:
    hour, minute = d.num(1, 12), d.num(0, 11) * 5
    return f"What is the smaller angle between the hour hand and the minute hand of a clock at {hour}:{minute:02d}?"


def who_owns(d: Draw) -> str:
    """Three people, three things each one owns, and true clues until exactly one assignment fits them."""
    names, things = [d.person().name for _ in range(3)], d.rng.sample(d.pick(OWNED), 3)
    truth = d.rng.sample(range(3), 3)  # names[i] owns things[truth[i]]
    facts = [(i, t, truth[i] == t) for i in range(3) for t in range(3)]
    d.rng.shuffle(facts)
    clues = []
    for person, thing, owns in facts:
        if len([p for p in itertools.permutations(range(3)) if all((p[i] == t) == o for i, t, o in clues)]) == 1:
            break
        if not owns or d.rng.random() < 0.3:  # mostly "does not own" clues: they make the solver reason
            clues.append((person, thing, owns))
    text = " ".join(f"{names[i]} {'owns' if o else 'does not own'} the {things[t]}." for i, t, o in clues)
    return (f"{', '.join(names[:2])} and {names[2]} each own one of these: a {things[0]}, a {things[1]} and a "
            f"{things[2]}. {text} Who owns which?")


def syllogism(d: Draw) -> str:
    a, b, c = d.rng.sample(NONSENSE, 3)
    first, second = d.pick(("All", "Some", "No")), d.pick(("All", "Some", "No"))
    conclusion = d.pick((f"all {a} are {c}", f"some {a} are {c}", f"no {a} are {c}", f"some {c} are not {a}"))
    return f"{first} {a} are {b}. {second} {b} are {c}. Does it follow that {conclusion}? Answer yes or no."


PUZZLES = (ordering, weekday, knights_and_knaves, next_term, clock_angle, who_owns, syllogism)


# ----------------------------------------------------------------------------------------------------- sets

def generate(templates, n: int, seed, instructions=INSTRUCTIONS) -> list[str]:
    """n distinct problems, round-robin over the templates, each followed by a step-by-step instruction; problem k of
    a template is fixed by (seed, template, k)."""
    problems = {}  # a dict: the first of repeats, in order
    for k in itertools.count():
        if len(problems) == n or k > 50 * n:
            return list(problems)
        template = templates[k % len(templates)]
        rng = random.Random(f"{seed}:{template.__name__}:{k // len(templates)}")
        problems.setdefault(f"{template(Draw(rng))} {rng.choice(instructions)}")


def word_problems(n: int, seed: int = 0) -> list[str]:
    """Training prompts: n problems of the TRAIN_TEMPLATES."""
    return generate(TRAIN_TEMPLATES, n, seed)


def logic_puzzles(n: int, seed: int = 0) -> list[str]:
    """Training prompts: n logic puzzles (ordering, weekdays, knights and knaves, sequences, clock angles, who owns
    what, syllogisms)."""
    return generate(PUZZLES, n, seed, PUZZLE_INSTRUCTIONS)


def eval_word_problems(n: int = EVAL_PROMPTS) -> list[str]:
    """The `math` evaluation task: n problems of the EVAL_TEMPLATES, under their own seed and one instruction."""
    return generate(EVAL_TEMPLATES, n, EVAL_SEED, (EVAL_INSTRUCTION,))


def problem_frame(text: str) -> str:
    """A problem with its numbers and names masked: two problems of one template usually share it."""
    text = re.sub(r"\d+(\.\d+)?", "#", text)
    return re.sub(r"\b(" + "|".join(NAMES) + r")\b", "N", text)
