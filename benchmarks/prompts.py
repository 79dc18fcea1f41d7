"""Realistic chat prompts for the throughput benchmark's workloads (b) and (c).

``USER_PROMPTS`` mixes short questions, medium requests and long pasted texts, so that with
the SmolLM2 chat template around them they span about 20 to 300 tokens.
``SHARED_SYSTEM_PROMPT`` (562 tokens) is the common prefix of workload (c).
"""

SHARED_SYSTEM_PROMPT = """\
You are Atlas, the customer support assistant of Northwind Outdoor Supply, an online \
retailer of camping, hiking and climbing equipment based in Portland, Oregon. You answer \
questions from customers by chat. Follow these rules in every conversation.

Tone and format. Be friendly, concise and concrete. Use plain language and short \
paragraphs. When you give steps, number them. Never invent order numbers, tracking codes, \
prices or stock levels: if you need them, ask the customer or say that a human agent will \
look them up. Do not use emojis. Address the customer by name only if they gave it.

Orders and shipping. Standard shipping within the contiguous United States takes three \
to six business days and is free on orders over 75 dollars; below that it costs 7.95 \
dollars. Expedited shipping takes one to two business days and costs 19.95 dollars. We \
ship to Alaska, Hawaii and Canada with a surcharge, and we do not ship to other countries. \
Orders placed before noon Pacific time on a business day leave the warehouse the same day. \
Customers can change or cancel an order within one hour of placing it from their account \
page; after that, they must wait for delivery and return the items.

Returns and exchanges. Unused items in their original packaging can be returned within 60 \
days for a full refund to the original payment method. Used items can be returned within \
one year if they are defective; our gear team inspects them and decides between a repair, \
a replacement or a refund. Return shipping is free for defective items and costs 6.95 \
dollars otherwise. Sale items marked final sale cannot be returned. Refunds take five to \
ten business days after the warehouse receives the package.

Product advice. You may recommend product categories and explain how to choose between \
them, for example tent capacity, sleeping bag temperature ratings, boot fit or rope \
diameter. Always mention safety considerations for climbing, avalanche and water gear, and \
recommend professional instruction for technical climbing and backcountry skiing. Do not \
give medical advice; for injuries, tell the customer to contact a medical professional.

Membership. Northwind Trail Club members pay 30 dollars a year and get free expedited \
shipping, ten percent back in store credit on full-price items, and early access to sales. \
Membership can be cancelled at any time; the fee is refunded within 30 days of joining.

Escalation. If the customer is angry, reports a safety problem with a product, asks for a \
discount you are not allowed to give, or asks about a specific order's status, offer to \
connect them with a human agent, available from 6 am to 9 pm Pacific time every day.\
"""

USER_PROMPTS: tuple[str, ...] = (
    # Short questions.
    "What is the capital of Australia?",
    "How many ounces are in a pound?",
    "Give me three synonyms for 'happy'.",
    "What does HTTP stand for?",
    "Translate 'good morning' into Spanish and French.",
    "Is a tomato a fruit or a vegetable?",
    "Write a haiku about autumn rain.",
    "What is the boiling point of water in Fahrenheit?",
    "Name the planets of the solar system in order.",
    "How do I reverse a list in Python?",
    "What's the difference between weather and climate?",
    "Suggest a name for a grey kitten.",
    "Why is the sky blue?",
    "Convert 25 degrees Celsius to Fahrenheit.",
    "What year did the first moon landing happen?",
    "Explain recursion in one sentence.",
    "Give me a fun fact about octopuses.",
    "What is 17 times 23?",
    "How long should I boil an egg for a runny yolk?",
    "Recommend a good book for learning to cook.",
    "What is the plural of 'cactus'?",
    "Write a one-line motivational quote for Monday morning.",
    "Which is bigger, a kilobyte or a kibibyte?",
    "What does a git rebase do?",
    "List five common houseplants that are hard to kill.",
    "How do you say thank you in Japanese?",
    "What is photosynthesis?",
    "Tell me a short joke about programmers.",
    "What's a good stretch for lower back pain after sitting all day?",
    "Define the word 'ephemeral' and use it in a sentence.",
    # Medium requests.
    "I'm planning a three-day trip to Lisbon in early October with my partner. We like "
    "food, walking and a bit of history, but we don't enjoy crowded tourist traps. Can you "
    "suggest a rough plan for each day, including one day trip outside the city?",
    "Write a polite email to my landlord asking whether I can paint the living room a light "
    "grey. I've lived in the flat for two years, always paid rent on time, and I'm happy to "
    "repaint it white when I move out if needed.",
    "Explain the difference between a process and a thread to a junior developer. Use an "
    "analogy, then give a short concrete example of when you would choose one over the other.",
    "My sourdough bread comes out dense and gummy in the middle even though the crust looks "
    "done. I bake it at 230 C for 40 minutes in a Dutch oven. What could be going wrong and "
    "what should I try first?",
    "Summarize the main arguments for and against a four-day work week in a balanced way, "
    "in no more than six bullet points.",
    "I have chicken thighs, a can of coconut milk, spinach, an onion, garlic, rice and some "
    "curry powder. Give me a simple recipe for dinner for two that takes under 45 minutes.",
    "Write a SQL query that returns the top five customers by total order value in 2023 from "
    "tables customers(id, name) and orders(id, customer_id, amount, created_at).",
    "What are the main differences between renting and buying a home? I'm 29, have some "
    "savings, and might move cities for work in the next three years.",
    "Create a weekly workout plan for a beginner who has 30 minutes a day, four days a week, "
    "and only a pair of dumbbells and a yoga mat at home.",
    "Rewrite this sentence to be clearer and more professional: 'we kinda missed the "
    "deadline cause the data thing broke and nobody told us until like friday'.",
    "Explain how compound interest works, and show how much 5,000 dollars grows in ten "
    "years at 6 percent per year compounded annually.",
    "I keep procrastinating on my thesis. I have about four months left and roughly half of "
    "the writing still to do. Can you help me make a realistic plan and suggest a few "
    "habits that might help me stay on track?",
    "Write a short product description for a stainless steel water bottle that keeps drinks "
    "cold for 24 hours and hot for 12, aimed at hikers and commuters.",
    "What is the difference between machine learning, deep learning and artificial "
    "intelligence? Keep it accessible for someone without a technical background.",
    "Draft three interview questions to assess a candidate's teamwork skills for a project "
    "manager role, and explain what a good answer would include for each.",
    "Explain what a Python decorator is and write a small decorator that measures and prints "
    "how long a function takes to run.",
    "My tomato plants have yellow leaves at the bottom that are spreading upwards, with some "
    "brown spots. It has been rainy lately. What might be the cause and what should I do?",
    "Compare electric cars and hybrid cars for someone who drives about 60 kilometres a day, "
    "mostly on the highway, and can charge at home.",
    "Write a limerick about a cat who is convinced she is the manager of the office.",
    "I'm giving a five-minute toast at my sister's wedding. She loves hiking and terrible "
    "puns, and she met her husband at a board game night. Can you help me outline it?",
    "Explain the CAP theorem and give an example of a database that favors availability and "
    "one that favors consistency.",
    "What should I check before buying a used bicycle from an online marketplace? I'm not "
    "very experienced with bikes.",
    "Turn these notes into a clear paragraph: meeting moved to Thursday, budget approved but "
    "cut by ten percent, Maria leads the vendor review, need final slides by the 14th.",
    "How do vaccines train the immune system? Explain it like I'm twelve years old.",
    "Give me a list of ten creative team-building activities that work well for a remote "
    "team spread across three time zones.",
    "Write a bash one-liner that finds all files larger than 100 MB under my home directory "
    "and prints them sorted by size, largest first, then explain each part of it.",
    "What are some good strategies for negotiating a higher salary when I receive a job "
    "offer? I don't want to come across as greedy.",
    "Explain the difference between 'affect' and 'effect' with a few example sentences.",
    "Describe how a bill becomes a law in the United States, step by step.",
    "I want to start journaling but I never know what to write. Give me fifteen prompts for "
    "the first two weeks.",
    "We are a team of six engineers and our code reviews take too long: pull requests wait "
    "two or three days for a first review, reviewers leave dozens of nitpicks, and large "
    "changes get rubber-stamped because nobody has time to read them properly. What "
    "changes to our process would you suggest, and how could we measure whether they work "
    "after a month?",
    "My elderly father lives alone two hours away and has started forgetting to take his "
    "medication. He is proud and doesn't want help, but last week he took a double dose "
    "by mistake. What are some respectful ways to bring this up with him, and what simple "
    "tools or routines could help him without taking away his independence?",
    "I'm learning to play the guitar as an adult. I practise about twenty minutes most "
    "evenings, I can play a few open chords, but switching between them is slow and my "
    "fingertips hurt. I'd like to play simple songs with friends in three months. Can you "
    "suggest a practice routine for the next twelve weeks, week by week?",
    "Explain how public-key cryptography lets two people who have never met agree on a "
    "secret over an insecure network. Start with the intuition, then describe Diffie-"
    "Hellman key exchange with small numbers, and finally explain why it is vulnerable to "
    "a man-in-the-middle attack and how certificates solve that.",
    "Our neighborhood association wants to organize a monthly repair café where volunteers "
    "fix broken appliances, clothes and bikes for free. We have access to a community hall "
    "on Saturday mornings and about ten interested volunteers. What do we need to think "
    "about for the first event: liability, tools, publicity, how to run the day, and how "
    "to keep volunteers motivated?",
    # Long pasted texts.
    "Please summarize the following text in three sentences and then list the key dates it "
    "mentions.\n\nThe town library opened in 1911 with a donation of 2,000 books from a "
    "local merchant family. For its first decades it occupied two rooms above the post "
    "office, and it was run entirely by volunteers until 1936, when the council hired its "
    "first paid librarian, Edith Marlowe. Under Marlowe the collection tripled, and in 1952 "
    "the library moved into a purpose-built brick building on Elm Street designed by the "
    "architect Samuel Ortiz. A fire in 1978 destroyed the children's wing and about a "
    "quarter of the collection, but a fundraising campaign led by local schools rebuilt it "
    "within two years. In 2004 the library added public computers and a makerspace, and in "
    "2021 it began lending tools, musical instruments and seeds alongside books. Today it "
    "serves about 40,000 visitors a year.",
    "Review this Python function and point out any bugs, edge cases or style problems. Then "
    "suggest an improved version.\n\n```python\ndef average_scores(students):\n    total = "
    "0\n    for s in students:\n        total += s['score']\n    avg = total / "
    "len(students)\n    best = None\n    for s in students:\n        if best == None or "
    "s['score'] > best['score']:\n            best = s\n    result = {}\n    result['avg'] = "
    "round(avg)\n    result['best'] = best['name']\n    result['passed'] = [s['name'] for s "
    "in students if s['score'] > 50]\n    return result\n```\n\nThe input is a list of "
    "dictionaries with 'name' and 'score' keys. Scores are integers from 0 to 100.",
    "Here is a customer complaint we received. Write a reply from the support team that "
    "apologizes, explains what we will do, and keeps the customer.\n\n'I ordered a "
    "birthday gift for my son three weeks ago and paid extra for express delivery. The "
    'tracking page has said "in transit" for twelve days. I called twice and was told to '
    "wait. The party was last Saturday and I had to explain to a seven-year-old why his "
    "present wasn't there. I have been a customer for six years and I've never been this "
    "disappointed. I want a full refund including the delivery fee, and honestly I am "
    "thinking about closing my account.'",
    "I'm writing a cover letter for a junior data analyst position at a healthcare "
    "nonprofit. Here's my draft. Please make it more compelling and concise, keep it under "
    "250 words, and keep the facts.\n\n'Dear Hiring Manager, I am writing to apply for the "
    "Junior Data Analyst role. I recently graduated with a degree in statistics. During my "
    "studies I worked on a project analyzing hospital readmission rates using Python and "
    "SQL, which taught me a lot about cleaning messy data. I also volunteered for two years "
    "at a food bank where I built a spreadsheet to track donations, which reduced waste by "
    "about fifteen percent. I am very interested in healthcare because my mother is a nurse "
    "and I have seen how data can help patients. I am a hard worker and a fast learner. "
    "Thank you for considering my application. Sincerely, Jordan'",
    "Read this meeting transcript excerpt and extract the action items, with owners and "
    "deadlines where given.\n\nPriya: OK, so the launch is still planned for March 3rd. "
    "Tom, where are we on the onboarding emails?\nTom: Drafts are done, I need legal to "
    "review them. I'll send them over today.\nPriya: Great. Legal usually needs a week, so "
    "let's aim to have approval by the 20th. Sam, the pricing page?\nSam: The design is "
    "final but engineering hasn't started. I'll talk to Lena about capacity tomorrow.\n"
    "Lena: We can start next Monday if the copy is final by Friday.\nPriya: Sam, can you "
    "own getting the copy final by Friday then?\nSam: Yes.\nPriya: And I'll update the "
    "exec team on the timeline at Thursday's sync. Anything else? Tom?\nTom: We should "
    "also test the referral flow end to end. I can do that once staging is ready.",
    "Explain what this error means and how to fix it. I get it when I run my Flask app "
    "with gunicorn in Docker, but it works fine locally with flask run.\n\n[2024-05-02 "
    "10:14:03 +0000] [1] [INFO] Starting gunicorn 21.2.0\n[2024-05-02 10:14:03 +0000] [1] "
    "[INFO] Listening at: http://127.0.0.1:8000 (1)\n[2024-05-02 10:14:03 +0000] [7] "
    "[INFO] Booting worker with pid: 7\n\nWhen I open http://localhost:8000 on my machine, "
    'the browser says the connection was reset. My Dockerfile ends with CMD ["gunicorn", '
    '"app:app"] and I start the container with docker run -p 8000:8000 myapp. What am I '
    "missing?",
    "Here is the abstract of a paper. Explain it in plain language for a general audience, "
    "then list two questions a skeptical reader might ask.\n\n'We present a longitudinal "
    "study of 1,204 urban households examining the relationship between residential tree "
    "canopy cover and summer indoor temperatures. Using sensor data collected over three "
    "summers, we find that a ten percentage point increase in canopy cover within 100 "
    "meters of a home is associated with a 0.6 degree Celsius reduction in mean daytime "
    "indoor temperature, after controlling for building age, insulation, orientation and "
    "air conditioning use. The effect is strongest in single-story homes and in "
    "neighborhoods with lower median income, where air conditioning is less prevalent. We "
    "discuss implications for urban heat mitigation policy and equity.'",
    "Help me plan a vegetable garden. My plot is about 4 by 6 meters, gets full sun in the "
    "morning and partial shade after 3 pm, and the soil is heavy clay. I live in a "
    "temperate climate with last frost around mid-April and first frost in late October. "
    "I'd like to grow tomatoes, zucchini, beans, lettuce, carrots and some herbs, and I "
    "have about two hours a week for maintenance. I'm a beginner, so please explain how "
    "to improve the soil, how to lay out the beds, when to plant each crop, and which of "
    "these crops are easiest for a first year. Also tell me which mistakes beginners make "
    "most often.",
    "Translate the following paragraph into natural, fluent English, then note any phrases "
    "that were hard to translate.\n\n'Hier soir, nous sommes allés au petit restaurant au "
    "coin de la rue, celui dont tout le monde parle depuis des mois. Le service était un "
    "peu lent, mais le serveur avait un sens de l'humour qui a fait passer l'attente. "
    "J'ai pris le canard aux cerises, qui était fondant à souhait, et mon amie a choisi "
    "un risotto aux champignons qu'elle a trouvé un peu trop salé. Pour le dessert, nous "
    "avons partagé une tarte tatin tiède avec une boule de glace à la vanille. Bref, une "
    "soirée réussie, même si l'addition nous a fait un peu grincer des dents.'",
    "I'm preparing for a system design interview. Walk me through how you would design a "
    "URL shortener like bit.ly that handles 100 million new links per month and 10 "
    "billion redirects per month. Cover the API, the data model, how to generate short "
    "codes, the storage choice, caching, how to handle hot links, analytics, and how the "
    "design changes if we need links to expire. Please also estimate the storage needed "
    "for five years and the read and write queries per second, and mention the main "
    "trade-offs an interviewer would want me to discuss.",
    "Rewrite the following paragraph for a children's science magazine (ages 8 to 11), "
    "keeping it accurate but fun.\n\n'Tardigrades are microscopic invertebrates, typically "
    "0.3 to 0.5 millimeters long, found in habitats ranging from mountaintops to the deep "
    "sea. When their environment dries out, they can enter a state called cryptobiosis, "
    "in which they lose almost all of their body water and their metabolism slows to less "
    "than 0.01 percent of normal. In this state they can survive extreme temperatures, "
    "high levels of radiation, and even the vacuum of space, and they can be revived "
    "decades later by adding water.'",
    "Below is a short story opening. Continue it for about two paragraphs, keeping the "
    "same tone and point of view.\n\n'The lighthouse had been dark for eleven years when "
    "the light came back on. Mara saw it from her kitchen window at a quarter past two in "
    "the morning, a slow white sweep across the bay, and she stood there with the kettle "
    "in her hand until it had gone round three times. Nobody had a key. The keeper, old "
    "Mr. Alvarez, had died the winter the light went out, and the town had argued about "
    "what to do with the tower ever since. She put the kettle down, found her boots and "
    "the torch in the drawer by the door, and went out into the wind.'",
    "Please compare these two job offers and help me think through the decision.\n\nOffer "
    "A: a mid-size software company, 95,000 dollars base salary, 5 percent bonus, fully "
    "remote, 20 days of paid leave, a good health plan, a stable product, but slow career "
    "growth according to people I know there.\n\nOffer B: an early-stage startup, 85,000 "
    "dollars base plus stock options worth maybe 0.2 percent, hybrid with three days a "
    "week in an office 40 minutes away, unlimited paid leave, a decent health plan, and "
    "the chance to lead a small team within a year.\n\nI'm 31, have no children, some "
    "student debt, and I want to eventually become an engineering manager.",
    "Here is a paragraph from my essay. Please point out grammar mistakes, awkward "
    "phrasing and weak arguments, and then show a revised version.\n\n'Social media have "
    "changed how people gets their news. In the past, most people reads newspapers or "
    "watched the evening news, which was edited by professional journalists. Nowadays, "
    "anyone can post anything, and algorithms decides what we see based of what we "
    "clicked before. This is obviously bad because people only see things they agree "
    "with. Therefore, governments should ban algorithms from social media platforms "
    "immediately, since they are destroying democracy.'",
    "I run a small bakery and want to reduce food waste. Currently we bake about 300 items "
    "every morning: bread, croissants, muffins and cookies. At closing time we usually "
    "have 40 to 60 items left, which we give to staff or throw away. Sales are higher on "
    "weekends and on sunny days, and lower on Mondays. We use a simple point-of-sale "
    "system that can export daily sales to a spreadsheet. What practical steps could we "
    "take over the next two months to bake closer to actual demand, and what should we "
    "do with leftovers? Please keep the suggestions realistic for a team of four people "
    "without a data analyst.",
    "Explain what the following JavaScript code does, line by line, and whether there is "
    "a bug.\n\n```javascript\nasync function loadUsers(ids) {\n  const users = [];\n  "
    "ids.forEach(async (id) => {\n    const res = await fetch(`/api/users/${id}`);\n    "
    "const user = await res.json();\n    users.push(user);\n  });\n  return users;\n}\n\n"
    "loadUsers([1, 2, 3]).then((users) => {\n  console.log(`Loaded ${users.length} "
    "users`);\n});\n```\n\nWhen I run it, it always prints 'Loaded 0 users'.",
    "Write a detailed packing list for a one-week summer backpacking trip in the mountains, "
    "where nights can drop to about 2 degrees Celsius, there may be afternoon "
    "thunderstorms, and we'll filter water from streams. There are two of us and we want "
    "to keep each pack under 12 kilograms including food and water. Organize the list by "
    "category (shelter, sleeping, clothing, cooking, water, navigation, first aid, "
    "hygiene, and other), note which items can be shared between us, and mark the items "
    "people most often forget.",
)
