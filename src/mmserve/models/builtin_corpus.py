"""The fixed English text the built-in model's tokenizer is trained on (deterministic)."""

CORPUS = """\
A photo of a red car parked on a quiet street next to a small bakery with a green door.
Two cats are sleeping on a blue sofa while a dog watches them from the kitchen floor.
The image shows a busy market where people buy fruit, bread, fish and fresh vegetables.
What is in this picture? Describe the image in detail and count the objects you can see.
There is a white boat on the lake, and the mountains behind it are covered with snow.
A young woman is reading a book under a large tree in the park on a sunny afternoon.
The man in the yellow jacket is riding a bicycle across the bridge over the river.
This is a chart of monthly sales; the numbers rise in spring and fall in the winter.
The screenshot shows a web page with a search box, a menu, three buttons and a table.
Children are playing football in the field near the school after their lessons end.
An old clock hangs on the wall above the fireplace in a warm and quiet living room.
The plate holds two eggs, a slice of toast, some tomatoes and a cup of black coffee.
A train is arriving at the station and the passengers are waiting on the platform.
The sky is grey and it looks like rain, but the streets are still full of people.
Please answer the question about the image with one short sentence or a single word.
How many birds are sitting on the wire? There are five birds, and one is flying away.
The document contains a title, a date, two paragraphs of text and a signature below.
She painted the fence white, planted flowers in the garden and watered them at night.
A brown horse stands in the meadow beside a wooden barn with a red roof and open doors.
The city at night is bright with lights from tall buildings, shops, cars and street lamps.
What color is the umbrella? The umbrella is purple with small orange dots on the edge.
The robot picks up the box, turns to the left and places it carefully on the shelf.
In the center of the room there is a long table with eight chairs and a vase of roses.
The beach is crowded in summer; families swim, build sand castles and eat ice cream.
A chef is cutting onions and carrots on a board while a pot of soup boils on the stove.
The map shows the roads between the villages, the forest to the north and the sea.
He opened the window, looked at the garden and smiled because the sun was finally out.
The label on the bottle says the medicine should be taken twice a day with water.
A group of friends are sitting around a campfire, singing songs and telling stories.
The airplane is flying above the clouds, and the wing is visible through the window.
Is the person wearing glasses? Yes, the person wears round glasses and a grey hat.
The kitten is playing with a ball of wool on the carpet next to an empty basket.
Our team measured the height of each plant every week and wrote the results down.
The museum has paintings of ancient kings, golden coins, stone tools and clay pots.
A farmer drives a tractor through the wheat field as the evening light turns orange.
The street sign reads Main Street, and the traffic light above it is showing green.
Write a caption for this photograph that a person who cannot see it would find useful.
The little girl holds a balloon shaped like a star and laughs at the funny clown.
Snow covers the roofs of the houses, and smoke rises slowly from every chimney.
The graph compares the temperature in three cities over the first six months.
A laptop, a phone, a notebook and a pen are lying on the desk near the lamp.
The river flows under the old stone bridge and past the mill toward the valley.
Why is the road wet? It rained this morning, so the road is still wet and shiny.
The soldiers marched through the square while the band played and the crowd cheered.
Every morning the baker wakes early, bakes bread and opens the shop at seven.
The zebra and the giraffe drink water together from a pool on the dry plain.
This diagram explains how water evaporates, forms clouds and returns as rain.
A small fishing village sits between the cliffs, with boats resting in the harbor.
The teacher wrote the answer on the board, and the students copied it carefully.
Look at the left side of the image: a woman in a long coat is walking her dog.
"""
