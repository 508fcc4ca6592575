"""The vocabulary the synthetic stories and the task families draw from."""

# fmt: off
NAMES = [
    "Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Lily", "Max", "Ella", "Ben", "Nora", "Jack",
    "Ruby", "Finn", "Ivy", "Owen", "Lucy", "Noah", "Rosa", "Eli", "Anna", "Hugo", "Jade", "Omar",
]
PLACES = [
    "garden", "forest", "kitchen", "park", "river", "school", "market", "beach", "farm", "library",
    "hill", "village", "castle", "cave", "lake", "bakery",
]
OBJECTS = [
    "ball", "lamp", "book", "kite", "hat", "cup", "key", "box", "shoe", "coin", "map", "bell",
    "drum", "boat", "cake", "apple", "leaf", "stone", "rope", "brush", "spoon", "clock", "flag",
    "shell", "ring", "basket", "candle", "pencil", "blanket", "button", "feather", "mirror",
    "ladder", "bucket", "whistle", "pillow", "jar", "sock", "scarf", "umbrella", "wagon", "violin",
    "puzzle", "balloon", "bottle", "carrot", "cookie", "lantern", "ticket", "window", "teapot",
    "rocket", "robot", "painting", "letter", "crown", "compass", "tent", "sandwich", "marble",
]
ANIMALS = ["cat", "dog", "fox", "owl", "rabbit", "duck", "frog", "bear", "mouse", "horse", "goat", "turtle"]
ADJECTIVES = ["big", "small", "old", "new", "shiny", "quiet", "funny", "brave", "tiny", "soft", "strange", "happy"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "pink", "brown"]
FEELINGS = ["happy", "sad", "proud", "tired", "excited", "scared", "calm", "surprised"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "snowy"]
TIMES = ["morning", "evening", "afternoon", "night", "day"]
COUNT_NOUNS = ["apples", "stones", "shells", "coins", "cookies", "marbles", "leaves", "buttons"]
# fmt: on
