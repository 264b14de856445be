"""Topic, task and text lists for the prompt sets. TRAIN_* and HELDOUT_* are disjoint
(tests/test_distill_prompts.py checks it)."""

LANGUAGES = ["Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Rust", "Go", "Bash", "SQL", "Ruby", "Kotlin"]
NAMES = ["Anna", "Ben", "Carlos", "Dina", "Emil", "Fatima", "Grace", "Hiro", "Ivan", "Julia", "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya"]
MATH_ITEMS = ["apples", "marbles", "books", "stickers", "coins", "pencils", "cookies", "cards"]
RECIPIENTS = ["my manager", "a coworker", "my landlord", "my teacher", "a client", "my neighbor", "my team", "a friend", "my family"]

TRAIN_TOPICS = [
    # science
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "DNA replication", "the immune system",
    "climate change", "volcanoes", "earthquakes", "the solar system", "gravity", "electricity", "magnetism",
    "the periodic table", "chemical reactions", "evolution", "cell division", "the human heart", "the human brain",
    "vaccines", "antibiotics", "bacteria", "viruses", "the ozone layer", "ocean currents", "tides", "rainbows",
    "the speed of light", "quantum mechanics", "relativity", "atoms", "nuclear fusion", "nuclear fission",
    "renewable energy", "solar panels", "wind turbines", "batteries", "semiconductors", "lasers", "telescopes",
    "microscopes", "the moon", "Mars", "comets", "galaxies", "the Big Bang", "dinosaurs", "fossils", "coral reefs",
    "rainforests", "deserts", "glaciers", "hurricanes", "tornadoes", "lightning", "clouds", "soil erosion",
    "pollination", "bees", "ants", "whales", "octopuses", "migratory birds", "sleep", "nutrition", "metabolism",
    "muscles", "bones", "the digestive system", "allergies", "genetics", "stem cells", "photosynthetic algae",
    # technology
    "the internet", "cloud computing", "machine learning", "neural networks", "large language models",
    "computer viruses", "encryption", "passwords", "blockchain", "databases", "operating systems", "compilers",
    "open source software", "smartphones", "GPS", "3D printing", "robots", "self-driving cars", "electric cars",
    "drones", "virtual reality", "video game design", "web browsers", "search engines", "email", "Wi-Fi",
    "Bluetooth", "USB", "computer memory", "hard drives", "the CPU", "GPUs", "data centers", "cybersecurity",
    "social media", "spreadsheets", "version control", "APIs", "the command line", "Linux",
    # history and society
    "the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution", "the printing press",
    "the Silk Road", "the Vikings", "the French Revolution", "the Cold War", "the Moon landing", "democracy",
    "the United Nations", "human rights", "taxes", "inflation", "interest rates", "the stock market",
    "supply and demand", "small businesses", "marketing", "budgeting", "saving money", "credit cards",
    "insurance", "urban planning", "public transport", "libraries", "museums", "newspapers", "elections",
    "the Olympic Games", "world languages", "sign language", "translation", "etiquette", "holidays around the world",
    # arts and culture
    "jazz music", "classical music", "rock music", "hip hop", "painting", "sculpture", "photography",
    "film making", "animation", "theater", "poetry", "novels", "comic books", "fashion", "architecture",
    "pottery", "origami", "chess", "board games", "knitting", "calligraphy", "dance", "opera", "mythology",
    # everyday life
    "cooking pasta", "baking bread", "coffee", "tea", "chocolate", "spices", "vegetarian diets", "gardening",
    "houseplants", "composting", "recycling", "dogs", "cats", "horses", "aquariums", "running", "swimming",
    "cycling", "yoga", "meditation", "hiking", "camping", "fishing", "skiing", "football", "basketball", "tennis",
    "time management", "public speaking", "job interviews", "remote work", "teamwork", "leadership",
    "learning a new language", "studying for exams", "reading habits", "friendship", "parenting", "stress",
    "motivation", "habits", "minimalism", "home cleaning", "moving to a new city", "first aid", "fire safety",
    "road safety", "weather forecasts", "maps", "clocks", "calendars", "money", "banks", "shopping online",
    # places
    "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Kenya", "Mexico", "Norway", "Australia",
    "the Amazon river", "the Himalayas", "the Sahara", "Antarctica", "the Pacific Ocean", "islands",
    "big cities", "villages", "national parks", "bridges", "skyscrapers", "castles", "lighthouses", "trains",
    "airplanes", "ships", "submarines", "rockets", "satellites", "the International Space Station",
    # ideas
    "critical thinking", "the scientific method", "logic puzzles", "probability", "statistics", "algebra",
    "geometry", "prime numbers", "infinity", "fractions", "graphs and charts", "ethics", "philosophy",
    "happiness", "curiosity", "creativity", "kindness", "honesty", "patience", "courage",
]
HELDOUT_TOPICS = [
    "tsunamis", "penguins", "the Great Wall of China", "jellyfish", "wetlands", "the Eiffel Tower",
    "bamboo", "honey", "lichens", "the Andes", "mushrooms", "tarantulas", "sundials", "the Dead Sea",
    "hot air balloons", "glassblowing", "beekeeping equipment", "the Aztecs", "the Ottoman Empire",
    "the telegraph", "typewriters", "quasars", "neutrinos", "kidneys", "the lymphatic system", "caffeine",
    "sourdough starters", "sushi", "cheese making", "origami cranes", "the violin", "stained glass",
    "cryptography history", "compression algorithms", "spam filters", "solar eclipses", "auroras",
    "coral bleaching", "wolves", "the Mongol Empire", "canals", "tea ceremonies", "marathons", "sailing",
]

TRAIN_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of a number",
    "returns the n-th Fibonacci number", "sorts a list of numbers", "finds the largest element in a list",
    "counts the vowels in a string", "checks whether a string is a palindrome", "removes duplicates from a list",
    "merges two sorted lists", "implements binary search", "converts Celsius to Fahrenheit",
    "reads a text file and counts the words", "computes the average of a list", "finds the second largest number",
    "flattens a nested list", "checks whether two strings are anagrams", "computes the greatest common divisor",
    "generates a random password", "validates an email address", "converts a number to binary",
    "counts word frequencies in a text", "transposes a matrix", "multiplies two matrices",
    "implements a stack", "implements a queue", "implements a linked list", "reverses a linked list",
    "finds the intersection of two lists", "rotates an array by k positions", "capitalizes every word in a sentence",
    "parses a CSV line", "sums the digits of a number", "checks whether a year is a leap year",
    "computes the area of a circle", "finds all even numbers in a list", "implements bubble sort",
    "implements quicksort", "implements merge sort", "computes the power of a number recursively",
    "finds the longest word in a sentence", "counts the lines in a file", "converts a string to title case",
    "returns the minimum and maximum of a list", "checks whether a list is sorted", "computes a running total",
    "splits a list into chunks of size n", "finds the missing number in a sequence", "computes the median",
    "converts a dictionary to JSON", "parses a date string", "computes the number of days between two dates",
    "implements a simple calculator", "simulates rolling two dice", "shuffles a list", "zips two lists together",
    "finds the first non-repeating character", "compresses a string with run-length encoding",
    "checks balanced parentheses", "converts Roman numerals to integers", "converts integers to Roman numerals",
    "computes the sum of squares", "finds prime numbers up to n", "computes the mean and standard deviation",
    "removes whitespace from a string", "counts uppercase letters", "implements a binary tree",
    "computes the height of a binary tree", "performs a breadth-first search", "performs a depth-first search",
    "detects a cycle in a graph", "finds the shortest path in a grid", "memoizes a function",
    "retries a function call on failure", "measures how long a function takes", "reads environment variables",
    "downloads a web page", "sends an HTTP GET request", "creates a simple web server",
    "implements a to-do list", "stores key-value pairs in a file", "implements a simple cache",
    "validates a phone number", "formats a number with commas", "converts seconds to hours and minutes",
    "generates the multiplication table", "draws a triangle of stars", "implements FizzBuzz",
    "finds common elements in three lists", "groups words by their first letter", "sorts a list of dictionaries by a key",
    "deep copies a nested structure", "checks whether a number is a perfect square", "computes compound interest",
    "implements a counter class", "implements a bank account class", "implements a rectangle class",
    "selects rows from a table where a column is above a value", "joins two tables on an id column",
    "counts rows grouped by category", "finds duplicate rows in a table", "renames files in a folder",
    "backs up a directory", "lists the largest files in a directory", "prints the current date and time",
    "checks whether a port is open", "parses command line arguments", "logs messages to a file",
    "handles division by zero", "computes the Levenshtein distance", "implements a priority queue",
    "finds the mode of a list", "reverses the words in a sentence", "checks whether a number is an Armstrong number",
]
HELDOUT_TASKS = [
    "converts kilograms to pounds", "finds the longest common prefix of a list of strings",
    "checks whether a matrix is symmetric", "implements insertion sort", "counts the set bits in an integer",
    "validates a credit card number with the Luhn algorithm", "computes the dot product of two vectors",
    "finds the k most frequent words", "converts a hexadecimal string to decimal", "implements a trie",
    "finds pairs in a list that sum to a target", "computes Pascal's triangle", "implements a circular buffer",
    "removes vowels from a string", "checks whether a sentence is a pangram", "computes the LCM of two numbers",
    "merges two dictionaries", "finds the peak element in an array", "encodes a string in Caesar cipher",
    "computes the Collatz sequence for a number",
]
TRAIN_CONCEPTS = [
    "recursion", "closures", "generators", "decorators", "list comprehensions", "pointers", "references",
    "classes and objects", "inheritance", "polymorphism", "interfaces", "exceptions", "unit testing",
    "type hints", "async and await", "threads", "mutexes", "hash maps", "arrays", "linked lists", "trees",
    "graphs", "big O notation", "dynamic programming", "greedy algorithms", "regular expressions",
    "JSON", "REST APIs", "SQL joins", "indexes in databases", "transactions", "caching", "garbage collection",
    "memory leaks", "immutability", "pure functions", "higher-order functions", "lambda functions",
    "string formatting", "file handling", "modules and packages", "virtual environments", "git branches",
    "merge conflicts", "code reviews", "debugging", "logging", "environment variables", "containers",
    "continuous integration", "design patterns", "the singleton pattern", "dependency injection",
    "iterators", "enums", "structs", "mutable default arguments", "integer overflow", "floating point errors",
]
HELDOUT_CONCEPTS = [
    "coroutines", "monads", "tail call optimization", "bloom filters", "the observer pattern",
    "semaphores", "memoization", "bit manipulation", "operator overloading", "lazy evaluation",
]
TRAIN_ACTIVITIES = [
    "a birthday party", "a road trip", "a camping weekend", "a job interview", "a wedding toast",
    "a picnic in the park", "a first date", "a family reunion", "a study schedule", "a vegetable garden",
    "a weekly meal plan", "a workout routine", "a trip to Paris", "a trip to Tokyo", "a beach holiday",
    "a board game night", "a movie marathon", "a charity bake sale", "a surprise party", "moving house",
    "learning to play guitar", "training for a 5k run", "starting a blog", "starting a podcast",
    "adopting a dog", "adopting a cat", "a science fair project", "a book club meeting", "a team offsite",
    "a presentation at work", "a school fundraiser", "a dinner party", "a hiking trip", "a ski trip",
    "a first day at a new job", "a college application", "a garage sale", "a home office setup",
    "a budget for the month", "decluttering my closet", "a karaoke night", "a cooking class",
    "a museum visit with kids", "a rainy day at home", "a long flight", "a visit to my grandparents",
    "a language exchange meetup", "a photography walk", "a volunteering day", "a neighborhood cleanup",
    "a halloween costume", "a holiday gift list", "a thank you dinner", "a small wedding",
    "a retirement party", "a baby shower", "a graduation party", "a housewarming party", "a bike tour",
    "a fishing trip", "a yoga retreat", "a chess tournament", "a coding bootcamp", "a marathon",
    "a cross-country move", "a weekend in the mountains", "a trip to the zoo", "a camping trip with kids",
    "a new year's resolution", "a morning routine", "an evening routine", "a digital detox",
    "a reading challenge", "a meal prep Sunday", "a garden party", "a pottery class", "a dance class",
    "a concert", "a music festival", "a sleepover", "a tea party", "a barbecue", "a potluck",
]
HELDOUT_ACTIVITIES = [
    "a canoe trip", "a stargazing night", "a trivia night", "an escape room outing", "a wine tasting",
    "a kite festival", "a treasure hunt for kids", "a farmers market visit", "a snorkeling trip",
    "a poetry reading", "a quilting circle", "a bird watching morning", "a lantern festival",
    "a cider pressing day", "a theater audition", "a robotics club meeting", "a hackathon",
    "a rock climbing session", "a silent retreat", "a sushi making night",
]

HELDOUT_TEXTS = [
    "The city council voted on Tuesday to extend the riverside bike path by four kilometers. Construction will start in spring and is expected to take eight months. Officials say the new section will connect two neighborhoods that currently have no safe cycling route, and that the project is funded mostly by a regional transport grant.",
    "Researchers at a marine institute tagged forty sea turtles last year to track their migration. The data showed that several turtles traveled more than two thousand kilometers, and that most of them returned to the same beaches where they had hatched. The team hopes the results will help protect nesting sites.",
    "Our bakery will close early on Friday for staff training. We will reopen on Saturday at the usual time with a new seasonal menu, including pumpkin bread and apple tarts. Customers with pre-orders for Friday can pick them up before noon.",
    "A new study suggests that short walks after meals can help control blood sugar. Participants who walked for ten minutes after eating had lower glucose levels than those who sat still. The researchers note that the effect was strongest after dinner.",
    "The library is launching a seed exchange program. Visitors can take packets of vegetable and flower seeds for free and are encouraged to return seeds from their own gardens at the end of the season. The program aims to promote local gardening and biodiversity.",
    "After three years of development, the small game studio released its first title, a puzzle game set in an underwater city. Early reviews praise the art style and music, but some players say the later levels are too difficult. The studio has promised an update with an easier mode.",
    "Heavy rain caused flooding in several low-lying streets on Sunday night. Emergency crews pumped water from basements and closed two roads until Monday afternoon. No injuries were reported, and the weather service expects dry conditions for the rest of the week.",
    "The school introduced a program where older students tutor younger ones in reading twice a week. Teachers report that both groups benefit: younger students read more fluently, and the tutors gain confidence and patience. The school plans to expand the program to mathematics.",
    "A local farmer switched from conventional tilling to no-till methods five years ago. She says her soil now holds water better, her fuel costs have dropped, and yields have stayed about the same. Neighbors are watching the results closely before trying it themselves.",
    "The museum's new exhibit shows everyday objects from a thousand years ago, including combs, cooking pots and children's toys. Curators chose ordinary items on purpose, to show how people actually lived rather than only how kings and generals did.",
]
