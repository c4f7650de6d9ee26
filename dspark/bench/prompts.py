"""The built-in benchmark prompts: short chat requests of the kinds a small assistant model gets.

Written for this project (no dataset is read at run time). The order is fixed so that every run, and both arms of a
comparison, see the same prompts in the same order.
"""

from __future__ import annotations

BUILTIN_PROMPTS: list[str] = [
    # math word problems
    "A bakery sells 12 muffins per tray and bakes 7 trays each morning. If 15 muffins are left at closing, "
    "how many were sold? Show your steps.",
    "Tom is 3 times as old as his daughter. In 12 years he will be twice her age. How old are they now?",
    "A train leaves at 9:40 and travels 210 km at 84 km/h. At what time does it arrive?",
    "A shirt costs $40. It is discounted by 25% and then taxed at 8%. What is the final price?",
    "Sara saves $15 a week. How many weeks does she need to buy a bike that costs $225 if she already has $60?",
    "A rectangle has a perimeter of 36 cm and its length is twice its width. What is its area?",
    "Three pipes fill a tank in 6, 8 and 12 hours. How long do they take together?",
    "What is the sum of all integers from 1 to 200 that are divisible by 7?",
    # coding requests
    "Write a Python function that returns the n-th Fibonacci number using iteration.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain what this code does: `print(sorted(set(x.lower() for x in words)))`.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "How do I read a CSV file into a list of dictionaries in Python?",
    "Write a bash one-liner that counts the lines of every .py file in a directory tree.",
    "What is the difference between a list and a tuple in Python? Give an example of when to use each.",
    "Write a JavaScript function that debounces another function by a given number of milliseconds.",
    # explanations
    "Explain how a rainbow forms, in simple terms.",
    "Why is the sky blue during the day and red at sunset?",
    "What is photosynthesis and why does it matter for life on Earth?",
    "Explain the difference between weather and climate.",
    "How does a vaccine teach the immune system to fight a disease?",
    "What causes the seasons on Earth?",
    "Explain what inflation is and how it affects savings.",
    "How do airplanes stay in the air?",
    # writing
    "Write a short poem about autumn leaves.",
    "Write a polite email asking a colleague to review a document by Friday.",
    "Give me three tips for staying focused while studying.",
    "Write a two-sentence horror story.",
    "Describe a busy market in a small town in one paragraph.",
    "Suggest five names for a coffee shop that also sells books.",
    "Write a short thank-you note to a teacher.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
]
